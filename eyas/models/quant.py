"""Weight-only quantization for CPU decoding: int4 with per-group scales and zero points, and
int8 with per-group scales.

Why: on a CPU, decoding one token is bound by reading the weights. SmolLM2-135M ships as a
Q4_1 GGUF (4-bit codes, one scale and one minimum per group of 32 weights); holding the weights
in the same 4-bit form reads ~7x fewer bytes than float32. The products run in eyas's int4 x
int8 kernel where the CPU has AVX512-VNNI or AVX2 (csrc/int4_gemm.cpp; float16 scales and minimums,
as Q4_1 stores them), else in PyTorch's packed int4 kernel (Int4Linear.layout). Re-quantizing
weights that were dequantized from Q4_1 recovers the same codes whenever a group uses both its
extreme codes (almost always), so the model stays the one the GGUF describes.

int8 (Int8Linear: one float16 scale per 32 weights, GGUF's Q8_0 layout, csrc/int8_gemm.cpp)
holds a Q8_0 GGUF exactly and a Q6_K or 16-bit one within 1/254 of each group's largest weight,
for ~1.7x the bytes of int4: the accurate choice for sources above 5 bits.

Usage:
    from eyas.models.quant import quantize_model
    quantize_model(model, group_size=32)   # replaces the decoder's nn.Linear layers in place
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from eyas.models import extension

GROUP_SIZES = (32, 64, 128, 256)
INT8_GROUP = 32  # inputs per int8 scale: the Q8_0 block


def int4_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu")


def int8_available() -> bool:
    """Whether Int8Linear can run here: the extension with an int8 dot-product kernel."""
    return extension.int8dot_kernel() is not None


def quantize_int8_groups(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric 8-bit quantization of weight [O, I] by groups of INT8_GROUP inputs, as GGUF's
    Q8_0: scale = max|w| / 127 rounded to float16, code = round(w / scale).

    Returns codes [O, I] int8 in -127..127 and scales [O, I/32] float32 (float16 values). A
    group that Q8_0 quantized comes back with its own codes and scale (its largest code is
    +-127, so max|w| / 127 is its float16 scale exactly).
    """
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // INT8_GROUP, INT8_GROUP)
    scale = (groups.abs().amax(dim=-1) / 127).clamp(max=65504).half().float()  # [O, I/32]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    codes = torch.where(scale[..., None] > 0, (groups / safe).round().clamp(-127, 127), 0)
    return codes.to(torch.int8).reshape(out_features, in_features), scale


def quantize_groups(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit quantization of weight [O, I] by groups of `group_size` inputs.

    Returns codes [O, I] int32 in 0..15, scales [O, I/g] and minimums [O, I/g] (float32), with
    weight ~= codes * scale + minimum.
    """
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low = groups.amin(dim=-1, keepdim=True)
    high = groups.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32)
    return codes.reshape(out_features, in_features), scale.squeeze(-1), low.squeeze(-1)


def row_chunks(rows: int) -> list[int]:
    """How many rows each call of PyTorch's CPU int4 kernel gets, for `rows` rows in all.

    The kernel works in blocks of 4 rows and has slow paths: 5 rows cost as much as 8 (~1.9x
    the time of 4), and 32 rows ~12x the time of 16 (2 threads, old BENCHMARKS.md section 1). So
    passes over many tokens (prefill) go 16 rows at a time, and a remainder of 1 or 2 rows past
    a multiple of 4 gets a call of its own (5 = 4 + 1, 6 = 4 + 2, 9 = 8 + 1). Each output row
    is computed alone, so how the rows are split does not change any value.
    """
    sizes = [16] * (rows // 16)
    rest = rows % 16
    if rest > 4 and rest % 4 in (1, 2):
        sizes += [rest - rest % 4, rest % 4]
    elif rest:
        sizes.append(rest)
    return sizes


class Int4Linear(nn.Module):
    """y = x @ dequant(W)^T (+ bias) with W held as int4 codes, in one of two layouts:

    - "int8dot": the extension's int4 x int8 kernel (models/csrc/int4_gemm.cpp), where the
      extension is built with AVX512-VNNI or AVX2 (extension.int8dot_kernel): float16
      scales and minimums, activations rounded to 14-bit integers per 32 inputs. `packed` is
      uint8 [O/16, I/32, 320].
    - "torch": PyTorch's packed int4 kernel: bf16 scales and zero points, bf16 activations.
    """

    def __init__(self, linear: nn.Linear, group_size: int = 32) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        if in_features % group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of group {group_size}")
        codes, scale, low = quantize_groups(linear.weight.detach(), group_size)
        int8dot = group_size == 32 and out_features % 16 == 0 and extension.int8dot_kernel() is not None
        self.layout = "int8dot" if int8dot else "torch"
        if int8dot:
            self.register_buffer("packed", extension.module().int4_pack(codes, scale, low))
            self.register_buffer("scales_and_zeros", torch.empty(0))  # inside `packed`
        else:
            # The kernel computes (code - 8) * scale + zero, so zero = minimum + 8 * scale.
            zero = low + 8 * scale
            scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))  # [I/g, O, 2]
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.group_size = group_size
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: Tensor) -> Tensor:  # [..., I] -> [..., O]
        shape = x.shape
        if self.layout == "int8dot":
            flat = x.reshape(-1, shape[-1]).float()
            y = extension.module().int4_linear(flat, self.packed).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*shape[:-1], self.out_features)
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        sizes = row_chunks(flat.shape[0])
        if len(sizes) == 1:  # a decode step: one call, no split (~7 us of Python a call)
            y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch.cat([torch._weight_int4pack_mm_for_cpu(part, self.packed, self.group_size,
                                                             self.scales_and_zeros)
                           for part in flat.split(sizes)])
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Int8RowLinear(nn.Module):
    """y = x @ dequant(W)^T with W held as int8 codes and one scale per output row, bf16
    activations (PyTorch's int8 kernel): quantize_model's output layer."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-8)
        self.register_buffer("codes", (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.out_features = weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(flat, self.codes, self.scale).to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """y = x @ dequant(W)^T (+ bias) with W held as int8 codes and one float16 scale per 32
    inputs (symmetric: weight = code * scale, code in -127..127), in the extension's int8 x int8
    kernel (csrc/int8_gemm.cpp: activations rounded to 14-bit integers per 32 inputs, as in
    Int4Linear's int8dot layout). A Q8_0 GGUF's blocks are held exactly; `packed` is uint8
    [O/16, I/32, 544]. Needs the extension with an int8 dot-product kernel (AVX2 or AVX512-VNNI).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        if in_features % INT8_GROUP or out_features % 16:
            raise ValueError(f"int8 layers need in_features a multiple of {INT8_GROUP} and out_features of 16, "
                             f"not [{out_features}, {in_features}]")
        if not int8_available():
            raise RuntimeError("int8 weights need eyas's C++ extension with an int8 dot-product kernel "
                               "(AVX2 or AVX512-VNNI); EYAS_FUSED=0 turns it off")
        codes, scale = quantize_int8_groups(linear.weight.detach())
        self.register_buffer("packed", torch.ops.eyas.int8_pack(codes, scale))
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = in_features, out_features

    @classmethod
    def from_packed(cls, packed: Tensor, bias: Tensor | None, in_features: int, out_features: int) -> Int8Linear:
        """An Int8Linear around buffers that it packed earlier (the quantized-model cache)."""
        if tuple(packed.shape) != (out_features // 16, in_features // INT8_GROUP, 544):
            raise ValueError(f"packed int8 weights {tuple(packed.shape)} do not fit [{out_features}, {in_features}]")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.register_buffer("packed", packed)
        layer.register_buffer("bias", bias)
        layer.in_features, layer.out_features = in_features, out_features
        return layer

    def forward(self, x: Tensor) -> Tensor:  # [..., I] -> [..., O]
        shape = x.shape
        y = torch.ops.eyas.int8_linear(x.reshape(-1, shape[-1]).float(), self.packed).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def quantize_model(model: nn.Module, group_size: int = 32, lm_head: str = "int8") -> nn.Module:
    """Replace every nn.Linear of the decoder layers by Int4Linear (in place).

    lm_head: "int8" (per-row int8), "int4", or "keep" (leave it in the model's float dtype).
    The input embedding stays a float table (a lookup reads one row; it costs nothing).
    """
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, not {group_size}")
    if not int4_available():
        raise RuntimeError("this PyTorch build has no CPU int4 kernel (_weight_int4pack_mm_for_cpu)")
    for layer in model.layers:
        layer.self_attn.float64_attention = True
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int4Linear(child, group_size))
    model.fused_plan = None  # look again for the fused int4 layers (models/fused_cpu.py)
    head = model.lm_head
    if lm_head == "int8":
        model.lm_head = Int8RowLinear(head)
    elif lm_head == "int4":
        model.lm_head = Int4Linear(head, group_size)
    elif lm_head != "keep":
        raise ValueError(f"lm_head must be int8, int4 or keep, not {lm_head!r}")
    return model


def quantize_linears(module: nn.Module, group_size: int = 32) -> nn.Module:
    """Replace every nn.Linear inside `module` whose input width is a multiple of `group_size`
    and output width a multiple of 16 by Int4Linear (in place): a draft head served
    beside an int4 target. Its linear layers are read whole at every drafting pass, after the
    target's pass has pushed them out of the CPU caches, so their bytes set the pass's time
    (old BENCHMARKS.md section 6d)."""
    if not int4_available():
        raise RuntimeError("this PyTorch build has no CPU int4 kernel (_weight_int4pack_mm_for_cpu)")
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if (isinstance(child, nn.Linear) and child.in_features % group_size == 0
                    and child.out_features % 16 == 0):  # the kernel's packing needs both
                setattr(parent, name, Int4Linear(child, group_size))  # others stay float
    return module
