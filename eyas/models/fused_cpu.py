"""The int4 decoder stack in one C++ call: the CPU decode step without its Python overhead.

A decode step of int4 SmolLM2-135M spent ~4.5 ms in its 120 int4 matmuls and ~8 ms around
them: ~25 small ops per layer (norms, RoPE, dtype conversions, cache writes, float64 attention)
and the Python that issues them. `csrc/decoder_layer.cpp` does everything between the
matmuls in plain loops, and the model calls it once per pass for all its layers (FusedStack;
an EAGLE-3 head calls its one layer, eagle3/fused.py). The matmuls themselves run in
`csrc/int4_gemm.cpp` (int4 x int8 integer dot products on AVX512-VNNI or AVX2, 2.6-3.3x
PyTorch's int4 kernel on AVX512-VNNI; 14-bit activations, or 8-bit with
EYAS_INT4_ACTIVATIONS=8, extension.int4_activation_bits) where Int4Linear took its layout (extension.int8dot_kernel), else in PyTorch's
int4 kernel.

It is compiled on first use (models/extension.py: g++, ~25-45 s; `make setup` does it ahead of
time) into ~/.cache/eyas/ext (EYAS_EXT_DIR overrides). Where it cannot be built, or
with EYAS_FUSED=0, the model runs its Python layers: same results up to float rounding, and
since a process uses one or the other for every pass, speculative output stays identical to
plain output either way.

Usage:
    from eyas.models.fused_cpu import fused_layers
    stack = fused_layers(model)                # None unless every layer qualifies
    out = stack.run(x, cos, sin, cache, list(range(len(stack))), slots, kv_len, mask)
    taps = x.new_empty(len(x), 3, x.shape[1])  # [N, 3, H]: filled with the hidden entering layers 2, 15, 27
    out = stack.run(x, cos, sin, cache, list(range(len(stack))), slots, kv_len, mask,
                    tap_before=[2, 15, 27], taps=taps)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.models.extension import enabled, int4_activation_bits, int8dot_kernel, march, module, source_tag


KV_DTYPES = {"float32": torch.float32, "float16": torch.float16}
KV_DTYPE_CHOICES = ("auto", *KV_DTYPES)
DEFAULT_KV_DTYPE = "float16"  # what "auto" picks where it can (BENCHMARKS.md, "Kernels and precisions")


FLOAT16_HEAD_DIMS = (64, 128)  # the head dims whose attention reads a float16 cache (csrc/attention.cpp)


def kv_dtype(choice: str = "auto", head_dim: int = 64) -> torch.dtype:
    """The KV cache's dtype where the fused layers run, from a model's choice (`--kv-dtype`,
    load_target's kv_dtype): float16 (what "auto" picks: half the bytes that attention reads
    per key, as llama.cpp's default f16 cache; rounded to nearest when written, widened to
    float32 for the arithmetic) or float32. "auto" reads EYAS_KV_DTYPE first, where it is set,
    and keeps float32 where the attention kernel has no float16 path (a head dim other than 64
    or 128, or a build without AVX2, FMA and F16C); asked for explicitly, float16 there is an
    error at the first pass. Every pass of a process reads the same cache, so a speculative
    pass still gives each row the bits of a one-token step with either."""
    if choice == "auto":
        name = os.environ.get("EYAS_KV_DTYPE", "").strip().lower()
        if not name:
            return KV_DTYPES[DEFAULT_KV_DTYPE] if float16_attention(head_dim) else torch.float32
        if name not in KV_DTYPES:
            raise ValueError(f"EYAS_KV_DTYPE={name!r}: accepted values are {', '.join(KV_DTYPES)}")
        return KV_DTYPES[name]
    if choice not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {choice!r}: accepted values are {', '.join(KV_DTYPE_CHOICES)}")
    return KV_DTYPES[choice]


def float16_attention(head_dim: int) -> bool:
    """Whether the fused layers' attention can read a float16 cache of this head dim (the
    int4 kernels' AVX2 or AVX-512 build implies AVX2, FMA and F16C)."""
    return head_dim in FLOAT16_HEAD_DIMS and int8dot_kernel() is not None


@dataclass(frozen=True)
class FusedLayer:
    """The tensors and sizes of one int4 DecoderLayer, in the extension's argument order."""

    weights: tuple  # norm_in, qkv packed/scales/bias, o packed/scales, norm_post, gate_up, down
    group: int
    eps: float
    heads: int
    kv_heads: int


def _fused_layer(layer: nn.Module) -> FusedLayer | None:
    from eyas.models.quant import Int4Linear

    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(lin, Int4Linear) for lin in linears) or not attn.float64_attention:
        return None
    if attn.head_dim % 8 or attn.num_heads % attn.num_kv_heads:
        return None
    if attn.q_norm is not None or any(lin.bias is not None for lin in linears[1:]):
        return None
    groups = {lin.group_size for lin in linears}
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if len(groups) != 1 or norms[0].eps != norms[1].eps:
        return None
    if any(n.weight.dtype != torch.float32 for n in norms):
        return None
    qkv, o, gate_up, down = linears
    weights = (norms[0].weight.detach(), qkv.packed, qkv.scales_and_zeros, qkv.bias, o.packed,
               o.scales_and_zeros, norms[1].weight.detach(), gate_up.packed, gate_up.scales_and_zeros,
               down.packed, down.scales_and_zeros)
    return FusedLayer(weights, groups.pop(), float(norms[0].eps), attn.num_heads, attn.num_kv_heads)


def norm_matches_torch(norm) -> bool:
    """Whether the extension's torch_rms_norm gives F.rms_norm's bits for `norm` (a final
    RMSNorm, float32: a target's, an EAGLE-3 head's) on this machine and PyTorch build: checked
    on 256 random rows of its width, at scales from 1e-3 to 1e3 (its order of additions is
    aten's on x86, from cpu/SumKernel.cpp; a PyTorch that sums in another order fails here and
    keeps F.rms_norm)."""
    weight = norm.weight.detach()
    if weight.dtype != torch.float32 or weight.dim() != 1:
        return False
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(256, weight.shape[0], generator=generator)
    rows *= torch.logspace(-3, 3, 256)[:, None]
    expected = F.rms_norm(rows, (weight.shape[0],), weight, norm.eps)
    return torch.equal(module().torch_rms_norm(rows, weight, norm.eps), expected)


class FusedStack:
    """Every decoder layer of an int4 model, run by the extension's Int4Stack: a pass through
    any run of layers is one C++ call (csrc/int4_stack.cpp), with the bits of one
    int4_decoder_layer call per layer, and returns the EAGLE-3 taps from that same call."""

    def __init__(self, layers: list[FusedLayer]) -> None:
        first = layers[0]
        if any((l.group, l.eps, l.heads, l.kv_heads) != (first.group, first.eps, first.heads, first.kv_heads)
               for l in layers):
            raise ValueError("the fused stack needs the same group, eps and heads in every layer")
        self.layers = layers
        empty = torch.empty(0)
        weights = [w if w is not None else empty for layer in layers for w in layer.weights]
        self.native = module().Int4Stack(weights, first.group, first.eps, first.heads, first.kv_heads)
        self._norm_in_cpp: bool | None = None  # final_norm's check, made on first use
        self._every_layer = list(range(len(layers)))

    def final_norm(self, x: Tensor, norm: nn.Module) -> Tensor:
        """norm(x) for the stack's output x [..., H] float32, with F.rms_norm's bits: in one C++
        call where the extension's norm is checked to give them (after a pass, PyTorch's
        rms_norm of one row took ~0.25 ms, its small ops running cold), else the module."""
        if self._norm_in_cpp is None:
            self._norm_in_cpp = norm_matches_torch(norm)
        if not self._norm_in_cpp or x.dtype != torch.float32 or torch.is_grad_enabled():
            return norm(x)
        return module().torch_rms_norm(x.reshape(-1, x.shape[-1]), norm.weight, norm.eps).view(x.shape)

    def decode(self, tokens: Sequence[int], positions: Sequence[int], first_slot: int, embed: Tensor,
               cos_table: Tensor, sin_table: Tensor, cache, mask: Tensor | None, tap_before: Sequence[int],
               norm: nn.Module) -> list[Tensor] | None:
        """A single-stream step in one C++ call: `run` over every layer, then `final_norm`,
        its inputs gathered in C++ (embed [V, H], cos_table/sin_table [P, D] float32: the rows
        F.embedding and indexing give) -> [hidden [1, T, H]] (+ [taps [1, T, K * H]] with
        tap_before). None where the C++ norm is not F.rms_norm's bits here (then run and
        final_norm). Tokens at positions are written at slots first_slot.. of cache row 0."""
        if self._norm_in_cpp is None:
            self._norm_in_cpp = norm_matches_torch(norm)
        if not self._norm_in_cpp or torch.is_grad_enabled():
            return None
        return self.native.decode(tokens, positions, first_slot, embed, cos_table, sin_table, cache.keys,
                                  cache.values, _storage(cache, self._every_layer), mask, tap_before,
                                  norm.weight, norm.eps)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> FusedLayer:
        return self.layers[index]

    def run(self, x: Tensor, cos: Tensor, sin: Tensor, cache, layers: list[int], slots: Tensor,
            kv_len: int, mask: Tensor | None, sequences: Tensor | None = None,
            tap_before: Sequence[int] = (), taps: Tensor | None = None) -> Tensor:
        """x [N, H] float32 through `layers` (in order) -> [N, H]; cache a KVCache (float32,
        float64 or float16), cos/sin [N, D]. Dense: slots [B, T] int64 (N = B * T, row
        n = b * T + t in cache row b), mask [B, T, kv_len] bool or None. Ragged: `sequences`
        [N] int64 (each row's cache row), slots [N], mask [N, kv_len]. Taps: `taps`
        [N, len(tap_before), H] float32 is filled in place, taps[:, j] with the hidden
        entering layers[tap_before[j]] (0 <= tap_before[j] <= len(layers); len(layers): the
        output), in the same call."""
        if not layers and taps is None:
            return x
        return self.native.run(x, cos, sin, cache.keys, cache.values, layers, _storage(cache, layers), slots,
                               kv_len, mask, sequences, list(tap_before), taps)


def _storage(cache, layers: list[int]) -> list[int]:
    """Where each of `layers` keeps its keys and values in `cache`'s [L, ...] tensors (a cache
    that stores only some layers maps them: `storage_index`)."""
    storage = getattr(cache, "storage_index", None)
    return layers if storage is None else [storage[index] for index in layers]


def fused_layers(model: nn.Module) -> FusedStack | None:
    """The fused stack of an int4 model on the CPU with float64 attention (one FusedLayer per
    decoder layer), or None (another precision or device, qk-norm, EYAS_FUSED=0, or no
    extension)."""
    if not enabled() or model.norm.weight.device.type != "cpu":
        return None
    layers = [_fused_layer(layer) for layer in model.layers]
    if any(layer is None for layer in layers) or module() is None:
        return None
    return FusedStack(layers)


def kernel_tag(model: nn.Module) -> str:
    """Which code runs this model's passes: fused or Python layers, the int4 layouts
    (quant.Int4Linear) with the int8dot implementation, and the C++ sources' hash. Measured
    costs are cached under it."""
    from eyas.models.quant import Int4Linear

    layers = "fused" if model.fused_layers() else "python"
    if march() != "native":
        layers += f".{march()}"
    if model.fused_layers() and model.kv_dtype != torch.float32:
        layers += f".kv-{str(model.kv_dtype).removeprefix('torch.')}"
    layouts = {m.layout for m in model.modules() if isinstance(m, Int4Linear)}
    if "int8dot" in layouts:
        bits = "" if int4_activation_bits() == 14 else f".a{int4_activation_bits()}"
        layouts = (layouts - {"int8dot"}) | {f"int8dot.{module().int8dot_kernel()}{bits}"}
    return f"{layers}-{'+'.join(sorted(layouts)) or 'none'}-{source_tag()}"


def run_layer(layer: FusedLayer, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
              slots: Tensor, kv_len: int, mask: Tensor | None) -> Tensor:
    """x [N, H] float32 -> [N, H]; keys/values [B, KV, S, D] float64 (one layer of the cache),
    slots [B, T] int64 (N = B * T), cos/sin [N, D], mask [B, T, kv_len] bool or None."""
    return module().int4_decoder_layer(x, *layer.weights, layer.group, layer.eps, cos, sin, keys,
                                          values, slots, kv_len, mask, layer.heads, layer.kv_heads,
                                          None, None)
