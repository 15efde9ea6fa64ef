"""Read a GGUF checkpoint one tensor at a time, under Hugging Face names, as float32.

The file is memory-mapped (models/gguf_header.py): a tensor's bytes are read when it is asked for
(and their pages then dropped from the process's resident set), dequantized (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, F16, BF16, F32: gguf.quants'
own block formulas, so the values equal what transformers loads) and handed over; nothing else
of the file is held. A loader that quantizes each tensor as it arrives therefore never holds more
than one float32 tensor (engine/layerwise.py).

Usage:
    source = GGUFSource("model.Q4_K_M.gguf")
    source.names()                                    # {"model.embed_tokens.weight", ...}
    weight = source.get("model.layers.0.self_attn.q_proj.weight")   # [O, I] float32
    gguf_type_counts("model.gguf")                    # {"Q4_K": 168, "Q6_K": 28}: decoder matrices
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from eyas.errors import EyasError
from eyas.models.gguf_header import GGUFTensor, read_gguf_header

# Bits per weight of each GGUF tensor type (what `--dtype auto` reads).
GGUF_BITS: dict[str, int] = {
    "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "IQ4_NL": 4, "IQ4_XS": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5,
    "Q6_K": 6, "Q8_0": 8, "Q8_1": 8, "Q8_K": 8, "F16": 16, "BF16": 16, "F32": 32,
    "Q2_K": 2, "Q3_K": 3,
}

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
# llama.cpp's converter interleaves the rotary halves of q and k rows for these architectures;
# transformers (and so eyas) undoes it on load.
PERMUTED_ARCHITECTURES = ("llama",)
BLOCKS_PER_CHUNK = 1 << 12  # blocks per numpy call: its temporaries (~8x the output) stay a few MB


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors eyas does not read
    (e.g. rope_freqs.weight, which the config's rope scaling recomputes)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match and match.group(2) in LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"
    return None


def gguf_type_counts(path: str | Path) -> dict[str, int]:
    """How many decoder-layer matrices (blk.N.*.weight, 2-D) the GGUF holds of each type."""
    counts: dict[str, int] = {}
    for tensor in read_gguf_header(path).tensors.values():
        if tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and len(tensor.dims) == 2:
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def layer_weight_bits(counts: dict[str, int]) -> int:
    """Bits per weight of most decoder-layer matrices (weighted by count); 16 when unknown."""
    widths: dict[int, int] = {}
    for name, count in counts.items():
        width = GGUF_BITS.get(name, 16)
        widths[width] = widths.get(width, 0) + count
    return max(widths, key=widths.get) if widths else 16


def gguf_source_info(path: str | Path) -> dict:
    """What a resolved folder records about its GGUF (eyas_source.json): where it is, and the
    types of its decoder matrices (what `--dtype auto` decides on)."""
    counts = gguf_type_counts(path)
    return {"gguf": str(Path(path).resolve()), "layer_weight_bits": layer_weight_bits(counts),
            "layer_types": counts}


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """A GGUF tensor -> float32 numpy array in Hugging Face orientation ([O, I] for a
    matrix)."""
    return dequantize_data(tensor, np.asarray(tensor.data))


def dequantize_data(tensor: GGUFTensor, data: np.ndarray) -> np.ndarray:
    """Rows of `tensor.data` (all of it, or some rows: `tensor.data[ids]`) -> float32, in the
    shape of those rows' values. Quantized blocks go through gguf.quants' per-type formula in
    large chunks (its `dequantize` works 16 rows at a time: ~10x slower for an embedding
    table); each block depends on itself alone, so a row reads the same whichever rows come
    with it."""
    from gguf import quants

    qtype = tensor.tensor_type
    if qtype.name in ("F32", "F16"):
        return data.astype(np.float32)
    if qtype.name == "BF16":  # stored as uint16 words
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if qtype not in quants._type_traits:
        raise EyasError(f"GGUF tensor {tensor.name} has type {qtype.name}, which eyas cannot read; "
                        f"supported: {', '.join(sorted(GGUF_BITS))}")
    block_size, type_size = quants.GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(-1, type_size)
    kind = quants._type_traits[qtype]
    out = np.empty(blocks.shape[0] * block_size, dtype=np.float32)
    for start in range(0, blocks.shape[0], BLOCKS_PER_CHUNK):
        part = blocks[start : start + BLOCKS_PER_CHUNK]
        out[start * block_size : (start + part.shape[0]) * block_size] = kind.dequantize_blocks(part).ravel()
    return out.reshape(quants.quant_shape_from_byte_shape(data.shape, qtype))


def unpermute_rotary(weight: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation: rows [heads, D/2, 2] -> [heads, 2, D/2]."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class GGUFSource:
    """The tensors of a GGUF file under Hugging Face names, read and dequantized on demand."""

    def __init__(self, path: str | Path, heads: int | None = None, kv_heads: int | None = None) -> None:
        self.path = Path(path)
        self.header = read_gguf_header(self.path)
        self.architecture = str(self.header.metadata.get("general.architecture", "llama"))
        self.heads, self.kv_heads = heads, kv_heads
        self.tensors: dict[str, GGUFTensor] = {}
        for tensor in self.header.tensors.values():
            name = hf_name(tensor.name)
            if name is not None:
                self.tensors[name] = tensor

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name: str) -> Tensor:
        """The named tensor as float32 ([O, I] for a matrix), read from the file now."""
        if name not in self.tensors:
            raise EyasError(f"{self.path} has no tensor for {name}")
        tensor = self.tensors[name]
        weight = torch.from_numpy(dequantize(tensor))
        self._release(tensor)
        if self.architecture in PERMUTED_ARCHITECTURES and name.endswith((".q_proj.weight", ".k_proj.weight", ".q_proj.bias", ".k_proj.bias")):
            if self.heads is None or self.kv_heads is None:
                raise ValueError("GGUFSource needs heads and kv_heads to read llama q/k weights")
            weight = unpermute_rotary(weight, self.heads if "q_proj" in name else self.kv_heads)
        return weight

    def files(self) -> list[Path]:
        return [self.path]

    def _release(self, tensor: GGUFTensor) -> None:
        """Drop the mapped pages of a tensor already read from this process's resident set
        (they stay in the page cache): otherwise reading the file once would keep all of it
        resident, counted in the process's memory."""
        mapping = self.header.buffer
        if not hasattr(mapping, "madvise"):
            return
        start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(tensor.data_offset + tensor.n_bytes, len(mapping))
        if end > start:
            mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
