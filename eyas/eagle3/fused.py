"""The EAGLE-3 head's decoder layer as one C++ call on a CPU, beside an int4 target.

Why: a drafting pass of the head through `Eagle3Head.forward` is ~25 small PyTorch ops (two
norms and a concatenation, three projections, RoPE, a growing KV cache, attention, the MLP)
and the Python that issues them: ~1.2 ms for one row on the 2-core machine, where the int4
matmuls inside it take ~0.3 ms. The target's fused layer (models/csrc/decoder_layer.cpp)
computes the same layer once it also takes the token embeddings: attention input
cat(RMSNorm(embeds), RMSNorm(hidden)), residual the hidden state. This module packs the head's
int4 q/k/v and gate/up projections together (the int8dot layout is blocks of 16 output
columns, so packed weights concatenate), keeps the head's keys and values in a preallocated
float32 cache, and runs fc, the layer and the output layer in three calls; the last one also
computes the final norm (models/csrc/head_output.cpp), as F.rms_norm does it, bit for bit: in a
drafting step F.rms_norm's ~15 small ATen ops cost 40-75 us of cold code, more than the
output layer's arithmetic.

The head class stays one (`Eagle3Head`, trained and served alike): this is its inference path
where the extension runs the target, and `tests/eagle3/test_fused_head.py` checks it against
`Eagle3Head.forward`. Its numbers differ from the Python path in float rounding only; the
head proposes, the target decides, so speculative output stays lossless either way.

Usage:
    fused = FusedHead.build(head)          # None unless the head's linears are int4 (int8dot)
    cache = fused.new_cache()
    hidden = fused.run(hidden, ids, positions, first_slot, cache, mask)  # [T, H] rows

Per pass, the tensors around the C++ call come from buffers kept by size (RoPE tables, slot
numbers, causal masks): a drafting step is a few rows, where creating them each time (a tril,
an arange, an index) cost more than the int4 matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from eyas.eagle3.head import Eagle3Head
from eyas.models import extension
from eyas.models.fused_cpu import norm_matches_torch
from eyas.models.quant import Int4Linear
from eyas.models.row_copies import RowCopies

EMBED_ROWS = 64  # token ids `embeds` copies through NumPy (more: a PyTorch lookup)


class HeadCache:
    """The head's keys and values [1, KV, S, D] float32, grown (doubled) on demand: rows live
    at slots equal to their position for committed rows, scratch tree rows after them."""

    def __init__(self, kv_heads: int, head_dim: int, slots: int = 256) -> None:
        self.keys = torch.zeros(1, kv_heads, slots, head_dim)
        self.values = torch.zeros_like(self.keys)

    def ensure(self, slots: int) -> None:
        have = self.keys.shape[2]
        if slots <= have:
            return
        size = max(slots, 2 * have)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(1, old.shape[1], size, old.shape[3])
            new[:, :, :have] = old
            setattr(self, name, new)


@dataclass(frozen=True)
class FusedHead:
    head: Eagle3Head
    weights: tuple  # in int4_decoder_layer's order: norm_in, qkv, o, norm_post, gate_up, down
    norm_embeds: Tensor  # [H] the layer's input_layernorm (on the token embeddings)
    eps: float
    fc_packed: Tensor | None  # fc's int8dot weights, None where fc is another linear
    lm_head_packed: Tensor | None  # the same for lm_head
    norm_in_cpp: bool  # the final norm inside lm_head's call (rms_norm_int4_linear): the same bits here
    _tables: list = field(default_factory=lambda: [torch.empty(0), torch.empty(0)])  # cos, sin [S, D]
    _slots: list = field(default_factory=lambda: [torch.empty(0, dtype=torch.long)])  # [S] 0, 1, ..
    _causal: dict = field(default_factory=dict)  # rows T -> [T, S] bool, row t sees columns <= S - T + t
    _embed_rows: list = field(default_factory=lambda: [None])  # [RowCopies of the table] for `embeds`
    native: object = None  # the extension's Int4HeadLayer (`step`), where fc is in the int8dot layout

    @staticmethod
    def supported(head: Eagle3Head) -> bool:
        """Whether `head` can run fused: the extension (EYAS_FUSED), float32 norms and every
        linear of the layer in the int8dot layout (quantize_linears beside an int4 target, on
        a CPU with AVX2)."""
        layer = head.midlayer
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if not extension.enabled() or extension.module() is None or head.device.type != "cpu":
            return False
        if not all(isinstance(lin, Int4Linear) and lin.layout == "int8dot" and lin.bias is None for lin in linears):
            return False
        norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm)
        return all(n.weight.dtype == torch.float32 for n in norms) and attn.head_dim % 8 == 0

    @classmethod
    def build(cls, head: Eagle3Head) -> FusedHead | None:
        """The fused path of `head` (its weights packed for the extension), or None where it is
        not `supported`."""
        if not cls.supported(head):
            return None
        layer = head.midlayer
        attn, mlp = layer.self_attn, layer.mlp
        empty = torch.empty(0)
        qkv = torch.cat([attn.q_proj.packed, attn.k_proj.packed, attn.v_proj.packed])  # blocks of 16 columns
        gate_up = torch.cat([mlp.gate_proj.packed, mlp.up_proj.packed])
        weights = (layer.hidden_norm.weight.detach(), qkv, empty, None, attn.o_proj.packed, empty,
                   layer.post_attention_layernorm.weight.detach(), gate_up, empty, mlp.down_proj.packed, empty)
        lm_head_packed = _int8dot_weights(head.lm_head)
        fc_packed = _int8dot_weights(head.fc)
        norm_embeds = layer.input_layernorm.weight.detach()
        native = None
        if fc_packed is not None:
            native = extension.module().Int4HeadLayer([w if w is not None else empty for w in weights], 32,
                                                      float(layer.input_layernorm.eps), attn.num_heads,
                                                      attn.num_kv_heads, norm_embeds, fc_packed)
        return cls(head, weights, norm_embeds, float(layer.input_layernorm.eps), fc_packed, lm_head_packed,
                   lm_head_packed is not None and norm_matches_torch(head.norm), native=native)

    def new_cache(self) -> HeadCache:
        attn = self.head.midlayer.self_attn
        return HeadCache(attn.num_kv_heads, attn.head_dim)

    def rope(self, positions: Tensor | Sequence[int]) -> tuple[Tensor, Tensor]:
        """cos, sign-folded sin [T, D] for positions [T] (a tensor or ints), as Eagle3Head.rope
        computes them, from tables grown on demand (a draft pass is too short to pay for
        computing them). Consecutive or equal positions given as ints are slices of the tables."""
        self._grow_tables((int(positions.max()) if isinstance(positions, Tensor) else max(positions)) + 1)
        cos, sin = self._tables
        if isinstance(positions, Tensor):
            return cos[positions], sin[positions]
        first, last, count = positions[0], positions[-1], len(positions)
        if last - first == count - 1 and all(b - a == 1 for a, b in zip(positions, positions[1:])):
            return cos[first : last + 1], sin[first : last + 1]  # contiguous views
        if all(p == first for p in positions):
            return cos[first].expand(count, -1).contiguous(), sin[first].expand(count, -1).contiguous()
        index = torch.tensor(positions)
        return cos[index], sin[index]

    def _grow_tables(self, needed: int) -> None:
        if self._tables[0].shape[0] < needed:
            size = max(needed, 2 * self._tables[0].shape[0], 512)
            cos, sin = self.head.rope(torch.arange(size)[None], torch.float32)  # [1, 1, S, D]
            half = cos.shape[-1] // 2
            sign = torch.cat([-torch.ones(half), torch.ones(half)])
            self._tables[:] = [cos[0, 0].contiguous(), (sin[0, 0] * sign).contiguous()]

    def slots(self, first_slot: int, count: int) -> Tensor:
        """[1, T] int64 slot numbers first_slot.. (a view of a kept arange)."""
        end = first_slot + count
        if self._slots[0].shape[0] < end:
            self._slots[0] = torch.arange(max(end, 2 * self._slots[0].shape[0], 512))
        return self._slots[0][first_slot:end][None]

    def causal_mask(self, rows: int, first_slot: int) -> Tensor:
        """[T, first_slot + T] bool: every slot before first_slot and the rows up to itself,
        as ones(T, first_slot + T).tril(first_slot); a view of a kept mask for short passes."""
        kv_len = first_slot + rows
        if rows > 16:  # a prompt's rows: once per request
            return torch.ones(rows, kv_len, dtype=torch.bool).tril(first_slot)
        kept = self._causal.get(rows)
        if kept is None or kept.shape[1] < kv_len:
            width = max(kv_len, 2 * (0 if kept is None else kept.shape[1]), 512)
            kept = self._causal[rows] = torch.ones(rows, width, dtype=torch.bool).tril(width - rows)
        return kept[:, kept.shape[1] - kv_len :]

    def run(self, hidden: Tensor, input_ids: Tensor | Sequence[int], positions: Tensor | Sequence[int],
            first_slot: int, cache: HeadCache, mask: Tensor | None = None) -> Tensor:
        """One draft pass over T rows: hidden [T, 3*Ht] taps or [T, H] own outputs, input_ids
        [T] and positions [T] (tensors or ints). Writes the rows' keys and values at slots
        first_slot.. of `cache` and returns the layer's output [T, H] (before the final norm;
        `head.compute_logits`).
        mask [T, first_slot + T] bool (True = may attend; the columns are cache slots); None:
        every earlier slot and the rows before it (causal)."""
        head, length = self.head, len(input_ids)
        if hidden.shape[-1] == head.config.fused_input_size:
            hidden = _linear(head.fc, self.fc_packed, hidden)
        if hidden.dtype != torch.float32 or not hidden.is_contiguous():
            hidden = hidden.float().contiguous()  # [T, H]
        kv_len = first_slot + length
        cache.ensure(kv_len)
        if mask is None and length > 1:
            mask = self.causal_mask(length, first_slot)
        slots = self.slots(first_slot, length)  # [1, T]
        embeds = self.embeds(input_ids)  # [T, H]
        cos, sin = self.rope(positions)
        attn = head.midlayer.self_attn
        return extension.module().int4_decoder_layer(
            hidden, *self.weights, 32, self.eps, cos, sin, cache.keys, cache.values, slots, kv_len,
            None if mask is None else mask[None], attn.num_heads, attn.num_kv_heads, embeds, self.norm_embeds)

    def step(self, hidden: Tensor, input_ids: Sequence[int], positions: Sequence[int], first_slot: int,
             cache: HeadCache, mask: Tensor | None = None) -> Tensor:
        """`run` for hidden [1, T, *] float32 and ids and positions given as ints -> [1, T, H],
        in one C++ call (Int4HeadLayer: fc, the embedding and rotary rows, the slots and the
        causal mask gathered there, the same bits): a drafting step's small PyTorch ops ran
        cold after the target's pass. mask [1, T, first_slot + T] or None. Where the extension
        does not take it (fc in another layout, another dtype), `run`."""
        weight = self.head.embed_tokens.weight
        if self.native is None or hidden.dtype != torch.float32 or weight.dtype != torch.float32:
            return self.run(hidden[0], input_ids, positions, first_slot, cache,
                            None if mask is None else mask[0])[None]
        self._grow_tables(max(positions) + 1)
        cache.ensure(first_slot + len(input_ids))
        cos, sin = self._tables
        return self.native.step(hidden, input_ids, positions, first_slot, weight, cos, sin, cache.keys,
                                cache.values, mask)

    def embeds(self, input_ids: Tensor | Sequence[int]) -> Tensor:
        """[T, H] float32 token embeddings of input_ids [T] (a tensor or ints). Ints with a
        float32 table: the rows copied through NumPy into a kept buffer (models/row_copies.py),
        valid until the next call (`run` hands it to its C++ call at once): a PyTorch lookup took ~50 us a drafting
        step here, its ops running cold after the target's pass."""
        weight = self.head.embed_tokens.weight
        if not isinstance(input_ids, Tensor):
            if weight.dtype == torch.float32 and len(input_ids) <= EMBED_ROWS:
                rows = self._embed_rows[0]
                if rows is None or rows.table is not weight:
                    rows = self._embed_rows[0] = RowCopies(weight, EMBED_ROWS)
                return rows.write(input_ids)
            input_ids = torch.tensor(input_ids)
        return F.embedding(input_ids, weight).float().contiguous()

    def logits(self, hidden: Tensor) -> Tensor:
        """[T, H] the layer's output (float32) -> [T, N] draft-vocabulary logits:
        `head.compute_logits`'s norm and output layer, the same bits: one C++ call where the
        extension computes the norm as F.rms_norm does (`norm_in_cpp`), else the same ops
        called without the modules around them."""
        norm = self.head.norm
        if self.norm_in_cpp and hidden.dtype == torch.float32:
            return extension.module().rms_norm_int4_linear(hidden, norm.weight, norm.eps, self.lm_head_packed)
        normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), norm.weight.float(), norm.eps).to(hidden.dtype)
        return _linear(self.head.lm_head, self.lm_head_packed, normed)


def _int8dot_weights(linear) -> Tensor | None:
    plain = isinstance(linear, Int4Linear) and linear.layout == "int8dot" and linear.bias is None
    return linear.packed if plain else None


def _linear(linear, packed: Tensor | None, x: Tensor) -> Tensor:
    """linear(x) for x [T, I]: Int4Linear.forward's int8dot kernel call where `packed`."""
    if packed is None:
        return linear(x)
    if x.dtype == torch.float32 and x.dim() == 2:  # the kernel's own input: no conversions around it
        return extension.module().int4_linear(x, packed)
    return extension.module().int4_linear(x.reshape(-1, x.shape[-1]).float(), packed).to(x.dtype)
