"""`load_target`: a model spec -> the lean model, its tokenizer and config, ready to decode.

Usage:
    from eyas.engine.target import load_target
    target = load_target("smollm2-135m")                 # precision "auto": fastest measured
    target = load_target("/models/Qwen2.5-0.5B-Instruct", dtype="float32", device="cuda")
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.models.config import ModelConfig
from eyas.models.cpu_linear import transpose_linears
from eyas.models.fused_cpu import KV_DTYPE_CHOICES
from eyas.models.layerwise import load_layerwise
from eyas.models.llama import Transformer
from eyas.models.output_layer import ScreenedOutputLayer
from eyas.models.quant import int4_available, int8_available
from eyas.models.registry import resolve_model, source_layer_types, source_weight_bits
from eyas.models.weight_source import gguf_file, open_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "int4": decoder matrices held as 4-bit codes with a scale and minimum per 32 weights (the
# Q4_1 layout), bf16 activations inside those matmuls, everything else float32.
# "int8": decoder matrices as 8-bit codes with a float16 scale per 32 weights (the Q8_0 layout),
# 14-bit activations inside those matmuls (csrc/int8_gemm.cpp), everything else float32.
PRECISIONS = ("auto", *DTYPES, "int4", "int8")


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
        return self.model.norm.weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """Dtype of the target's KV caches (Transformer.kv_dtype: int4 on a CPU, float16 or
        float32 as load_target's kv_dtype says, float64 without the fused layers; otherwise the
        weights' dtype)."""
        return self.model.kv_dtype

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids


AUTO_INT4_MAX_BITS = 6  # a GGUF at <= 6 bits per weight loses little more in int4 (Q4_1 layout)


def resolve_precision(name: str, device: torch.device, folder: Path) -> str:
    """Turn 'auto' into a concrete precision (see BENCHMARKS.md for the measurements) and say
    on stderr what was chosen and why.

    CPU: a model that came from a GGUF quantized at <= 6 bits per weight (Q4_*, Q5_*, Q6_K)
    runs in int4, ~2x the tokens/s of float32 (a 4-bit GGUF's codes are kept exactly; 5- and
    6-bit ones are rounded to 4 bits); a GGUF above 6 bits (Q8_0, F16, BF16, F32) in int8 (a
    Q8_0 GGUF's blocks exactly; 16- and 32-bit weights rounded to 8 bits per 32), ~1.8-2.7x
    the tokens/s of float32 with the same greedy output on a Q8_0 model; any other model in
    float32 (bf16 matmuls are not faster on CPUs without AVX512-BF16). CUDA: bfloat16.
    """
    if name not in PRECISIONS:
        raise EyasError(f"unknown precision '{name}'; accepted: {', '.join(PRECISIONS)}")
    if name != "auto":
        if name in ("int4", "int8") and device.type != "cpu":
            raise EyasError(f"precision {name} runs on the CPU only; use bfloat16 on CUDA")
        if name == "int8" and not int8_available():
            raise EyasError("precision int8 needs eyas's C++ extension with an int8 dot-product kernel "
                            "(AVX2 or AVX512-VNNI), which is not available here; use int4 or float32")
        return name
    chosen, reason = auto_precision(device, folder)
    print(f"[eyas] --dtype auto: {chosen} ({reason})", file=sys.stderr, flush=True)
    return chosen


def auto_precision(device: torch.device, folder: Path) -> tuple[str, str]:
    """(precision, why) for --dtype auto."""
    if device.type == "cuda":
        return "bfloat16", "on CUDA"
    bits = source_weight_bits(folder)
    types = source_layer_types(folder) or {}
    described = ", ".join(f"{count} {kind}" for kind, count in sorted(types.items(), key=lambda t: -t[1]))
    if bits is None:
        return "float32", "not a GGUF: the checkpoint's own weights, unquantized"
    if bits > AUTO_INT4_MAX_BITS:
        if not int8_available():
            return "float32", (f"GGUF decoder matrices at {bits} bits ({described}); int8 needs eyas's "
                               f"C++ extension with an int8 dot-product kernel, not available here")
        how = "held exactly (the Q8_0 layout)" if bits == 8 else f"rounded from {bits} to 8 bits per 32 weights"
        return "int8", (f"GGUF decoder matrices at {bits} bits ({described}), {how}; "
                        f"--dtype float32 runs the GGUF's values in float32")
    if not int4_available():
        return "float32", "this PyTorch has no CPU int4 kernel"
    how = "kept at 4 bits" if bits == 4 else f"rounded from {bits} to 4 bits"
    return "int4", (f"GGUF decoder matrices at {bits} bits ({described}), {how}; "
                    f"--dtype int8 keeps more of them, --dtype float32 runs the GGUF's values unrounded")


def resolve_device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise EyasError(f"device '{name}' was asked for but CUDA is not available here; use cpu")
    if not (name == "cpu" or name.startswith("cuda")):
        raise EyasError(f"unknown device '{name}'; accepted: cpu, cuda, cuda:N")
    return torch.device(name)


def cache_name(folder: Path) -> str:
    """How the int4 cache names a model: the GGUF's file name, else the folder's name."""
    gguf = gguf_file(folder)
    return gguf.stem if gguf is not None else folder.name


def load_target(spec: str | Path, dtype: str = "auto", device: str = "cpu",
                cache: str | Path | None = None, kv_dtype: str = "auto") -> Target:
    """Load a target. `dtype` is a precision: auto, float32, bfloat16, float16, int4 or int8.
    `kv_dtype` is the KV cache's dtype where the fused int4 layers run (an int4 target on a
    CPU): auto (float16, float32 for head dims without the float16 attention path, or
    EYAS_KV_DTYPE where it is set), float16 or float32; the other
    precisions keep their own (float64 for int4 and int8 in the Python layers, else the
    weights' dtype)."""
    from transformers import AutoTokenizer

    if kv_dtype not in KV_DTYPE_CHOICES:
        raise EyasError(f"unknown KV cache dtype '{kv_dtype}'; accepted: {', '.join(KV_DTYPE_CHOICES)}")
    folder = resolve_model(str(spec), cache)
    torch_device = resolve_device(device)
    precision = resolve_precision(dtype, torch_device, folder)
    config = ModelConfig.from_folder(folder)
    source = open_weights(folder, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads)
    # int4, int8: quantized as each layer is read (or mapped from their cache); the output
    # layer stays float32 (the screen below)
    model = load_layerwise(config, source, precision, torch_device, name=cache_name(folder))
    model.kv_dtype_choice = kv_dtype
    if torch_device.type == "cpu":
        if precision in ("int4", "int8", "float32") and not isinstance(model.lm_head, ScreenedOutputLayer):
            # exact greedy argmax at int8 cost; the row-major weight [V, H] (the tied embedding,
            # or the output layer's own) is kept, not copied again
            model.lm_head = ScreenedOutputLayer(model.lm_head)
        if precision not in ("int4", "int8"):
            transpose_linears(model)  # float layers [in, out] (an output screen stays as it is)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Target(model=model, tokenizer=tokenizer, config=config, folder=folder,
                  device=torch_device, precision=precision)
