"""The target as the engines know it: the name they load it by and its weight dtype.

eyas names a target by an alias (smollm2-135m), a local folder or a .gguf file; SGLang, vLLM and
the speculators library load it by its Hugging Face id and serve it in its config's torch_dtype.
An export therefore
  - writes its weights (and config torch_dtype) in the target's dtype unless told otherwise:
    SGLang's `--dtype auto` gives a float32 draft config float16, which then meets a bfloat16
    target's hidden states (a dtype error at start-up);
  - names as the speculators verifier a model the engines can resolve: the alias's Hugging Face id
    from the model registry, or `--target-name` (required when the target has no registered id).

Each looks at `--model` first (when given), then at the target the head was trained with.

Usage:
    target_dtype_name(head.config, model="smollm2-135m")   # "bfloat16"
    target_dtype_of("/models/Llama-3.1-8B-Instruct")        # its config.json torch_dtype
    verifier_name(head.config, target_name=None)            # "HuggingFaceTB/SmolLM2-135M-Instruct"
"""

from __future__ import annotations

from pathlib import Path

from eyas.eagle3.config import Eagle3Config
from eyas.errors import EyasError
from eyas.models.registry import ALIASES
from eyas.utils.io import read_json

EXPORT_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _specs(config: Eagle3Config, model: str | None) -> list[str]:
    return [spec for spec in (model, config.target_model) if spec]


def folder_dtype_name(spec: str) -> str | None:
    """The torch_dtype in a Hugging Face folder's config.json; None for anything else (a GGUF
    converted by eyas is float32 only because it was dequantized, so it does not count)."""
    folder = Path(spec).expanduser()
    config_path = folder / "config.json"
    if not config_path.is_file() or (folder / "eyas_source.json").is_file():
        return None
    raw = read_json(config_path)
    if not isinstance(raw, dict):
        return None
    name = raw.get("torch_dtype") or raw.get("dtype")
    return name if name in EXPORT_DTYPE_NAMES else None


def target_dtype_of(spec: str) -> str | None:
    """The dtype name of one model spec: a registered alias's, or a Hugging Face folder's."""
    return ALIASES[spec].torch_dtype if spec in ALIASES else folder_dtype_name(spec)


def target_dtype_name(config: Eagle3Config, model: str | None = None) -> str | None:
    """The target's dtype name, or None when neither `model` nor the head's target tells it."""
    for spec in _specs(config, model):
        found = target_dtype_of(spec)
        if found is not None:
            return found
    return None


def resolve_export_dtype(config: Eagle3Config, dtype: str, model: str | None = None) -> str:
    """`dtype` itself, or for "auto" the target's dtype; EyasError when that is unknown."""
    if dtype != "auto":
        if dtype not in EXPORT_DTYPE_NAMES:
            raise EyasError(f"export dtype '{dtype}' is not supported; accepted: auto, "
                            f"{', '.join(EXPORT_DTYPE_NAMES)}")
        return dtype
    found = target_dtype_name(config, model)
    if found is None:
        raise EyasError(f"cannot tell the target's dtype (the head was trained with "
                        f"'{config.target_model}', neither a registered alias nor a Hugging Face "
                        f"folder here): pass --dtype (the torch_dtype in the target's config.json: "
                        f"{', '.join(EXPORT_DTYPE_NAMES)}) or --model")
    return found


def verifier_name(config: Eagle3Config, target_name: str | None = None,
                  model: str | None = None) -> str:
    """The verifier a speculators export names: `target_name`, else the registered Hugging Face
    id of the target; EyasError when there is none."""
    if target_name:
        if target_name in ALIASES:
            raise EyasError(f"--target-name {target_name} is an eyas alias, which vLLM and speculators "
                            f"cannot resolve; use its Hugging Face id {ALIASES[target_name].hf_id}")
        return target_name
    for spec in _specs(config, model):
        if spec in ALIASES:
            return ALIASES[spec].hf_id
    raise EyasError(f"a speculators export names its verifier, and '{config.target_model}' (the "
                    f"target the head was trained with) has no Hugging Face id in the model "
                    f"registry: pass --target-name with the id or path the engine loads the target "
                    f"from (e.g. meta-llama/Llama-3.1-8B-Instruct)")
