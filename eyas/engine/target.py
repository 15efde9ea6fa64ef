"""`load_target`: a model spec -> the lean model, its tokenizer and config, ready to decode.

Usage:
    from eyas.engine.target import load_target
    target = load_target("smollm2-135m")                 # precision "auto": fastest measured
    target = load_target("/models/Qwen2.5-0.5B-Instruct", dtype="float32", device="cuda")
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eyas.errors import EyasError
from eyas.models.config import ModelConfig
from eyas.models.llama import Transformer
from eyas.models.cpu_linear import transpose_linears
from eyas.models.llama import rope_inverse_frequencies
from eyas.models.output_layer import ScreenedOutputLayer
from eyas.models.quant import int4_available, quantize_model
from eyas.models.registry import resolve_model, source_weight_bits

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "int4": decoder matrices held as 4-bit codes with a scale and minimum per 32 weights (the
# Q4_1 layout), bf16 activations inside those matmuls, everything else float32.
PRECISIONS = ("auto", *DTYPES, "int4")


@dataclass
class Target:
    model: Transformer
    tokenizer: Any
    config: ModelConfig
    folder: Path
    device: torch.device
    precision: str = "float32"

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """Dtype of the target's KV caches (Transformer.kv_dtype: float32, or float64 for int4 on a
        CPU without the fused layers)."""
        return self.model.kv_dtype

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids


def resolve_precision(name: str, device: torch.device, folder: Path) -> str:
    """Turn 'auto' into a concrete precision (see BENCHMARKS.md for the measurements).

    CPU: a model that came from a 4-bit GGUF runs in int4, which holds exactly the GGUF's codes
    (2x the tokens/s of float32 here); any other model runs in float32 (bf16 matmuls are not
    faster on CPUs without AVX512-BF16). CUDA: bfloat16.
    """
    if name not in PRECISIONS:
        raise EyasError(f"unknown precision '{name}'; accepted: {', '.join(PRECISIONS)}")
    if name != "auto":
        if name == "int4" and device.type != "cpu":
            raise EyasError("precision int4 runs on the CPU only; use bfloat16 on CUDA")
        return name
    if device.type == "cuda":
        return "bfloat16"
    return "int4" if source_weight_bits(folder) == 4 and int4_available() else "float32"


def resolve_device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise EyasError(f"device '{name}' was asked for but CUDA is not available here; use cpu")
    if not (name == "cpu" or name.startswith("cuda")):
        raise EyasError(f"unknown device '{name}'; accepted: cpu, cuda, cuda:N")
    return torch.device(name)


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(str(folder / "*.safetensors")))
    if not files:
        raise EyasError(f"no *.safetensors weights in {folder} (pickled .bin files are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> Transformer:
    """Build the model without random init (meta tensors), then load the weights into it."""
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    model.load_hf_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()})
    model.inv_freq = rope_inverse_frequencies(config).to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype=dtype).eval().requires_grad_(False)


def load_target(spec: str | Path, dtype: str = "auto", device: str = "cpu",
                cache: str | Path | None = None) -> Target:
    """Load a target. `dtype` is a precision: auto, float32, bfloat16, float16 or int4."""
    from transformers import AutoTokenizer

    folder = resolve_model(str(spec), cache)
    torch_device = resolve_device(device)
    precision = resolve_precision(dtype, torch_device, folder)
    config = ModelConfig.from_folder(folder)
    float_dtype = DTYPES.get(precision, torch.float32)
    model = build_model(config, load_weights(folder), float_dtype, torch_device)
    if precision == "int4":
        quantize_model(model, group_size=32, lm_head="keep")
    if torch_device.type == "cpu":
        transpose_linears(model, output_layer_only=precision == "int4")
        if precision in ("int4", "float32"):
            # exact greedy argmax at int8 cost; a tied embedding doubles as its row-major weight
            tied = model.embed_tokens.weight if config.tie_word_embeddings else None
            model.lm_head = ScreenedOutputLayer(model.lm_head, rows=tied)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Target(model=model, tokenizer=tokenizer, config=config, folder=folder,
                  device=torch_device, precision=precision)
