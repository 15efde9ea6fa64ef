"""A lean Llama-family transformer written for the eyas engine.

One file holds the whole model (gpt-fast style). What differs from a Hugging Face model:
- attention takes explicit positions [B, T] and an explicit boolean mask [B, T, S], so that a
  tree of draft tokens is verified in one pass;
- keys and values go to a pre-allocated `KVCache` at slots the caller chooses;
- q/k/v and gate/up projections are fused (fewer, larger matmuls: less Python dispatch);
- the forward can return the residual stream entering chosen layers (EAGLE-3 taps) for free;
- the forward can leave out chosen decoder layers (`skip_layers`: layer-skip self-speculation).

Usage:
    model = Transformer(config)
    model.load_hf_state_dict(state_dict)          # names as in Hugging Face checkpoints
    out = model(input_ids, positions, cache=cache, write_at=0, tap_layers=(2, 15, 27))
    out.logits  # [B, T, V]; out.taps: [B, T, 3*H]; out.hidden: [B, T, H] after the final norm
    model(..., greedy=True)  # logits whose argmax is exact, and nothing else (greedy decoding)
"""

from __future__ import annotations

import bisect
import contextlib
import math
from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.models import fused_cpu
from eyas.models.config import ModelConfig
from eyas.models.kv_cache import KVCache, RowsView
from eyas.models.sdpa import attention


@dataclass
class ForwardOutput:
    logits: Tensor | None  # [B, T_sel, V] (T_sel = T, or the rows picked by `logits_at`)
    hidden: Tensor  # [B, T, H] final hidden state, after the final norm (what lm_head reads)
    taps: Tensor | None  # [B, T, len(tap_layers) * H] residual stream entering each tap layer


def rope_inverse_frequencies(config: ModelConfig) -> Tensor:
    """Inverse frequencies [D/2] of rotary embeddings, with Llama-3 or linear scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        low_wavelength, high_wavelength = old_context / low, old_context / high
        smooth = (old_context / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
        middle = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
        inv_freq = torch.where(middle, smoothed, inv_freq)
    return inv_freq.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.float64_attention = False  # set by quantize_model (see forward)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: Tensor,  # [B, T, H]
        cos: Tensor,  # [B, T, 1, D]
        sin: Tensor,  # [B, T, 1, D], sign-folded (see Transformer.rope_tables)
        cache: KVCache | None,
        write_at: int | Tensor,  # int start slot, or slots [B, T]
        kv_len: int,
        mask: Tensor | None,  # [B, 1, T, S] bool, or None (attend to all S slots)
    ) -> Tensor:
        batch, length, _ = x.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(batch, length, heads + 2 * kv_heads, head_dim)
        if self.q_norm is not None:
            qkv = torch.cat(
                [self.q_norm(qkv[:, :, :heads]), self.k_norm(qkv[:, :, heads : heads + kv_heads]),
                 qkv[:, :, heads + kv_heads :]], dim=2)
        # Rotary embedding on q and k together: x * cos + rotate_half(x) * sin, where
        # rotate_half(x) * sin == roll(x, D/2) * sign-folded sin.
        qk = qkv[:, :, : heads + kv_heads]  # [B, T, Hq + KV, D]
        qk = torch.addcmul(qk * cos, qk.roll(head_dim // 2, dims=-1), sin)
        q = qk[:, :, :heads].transpose(1, 2)  # [B, Hq, T, D]
        k = qk[:, :, heads:].transpose(1, 2)  # [B, KV, T, D]
        v = qkv[:, :, heads + kv_heads :].transpose(1, 2)  # [B, KV, T, D]
        if self.float64_attention:
            # Rounding noise of float32 attention differs between a one-token pass and a
            # many-token (verification) pass; bf16-activation int4 matmuls downstream amplify it
            # into different tokens. In float64 the two agree after rounding back. The cache is
            # float64 too (Transformer.kv_dtype): converting it at every step cost more than
            # the attention itself.
            q, k, v = q.double(), k.double(), v.double()
        if cache is not None:
            cache.write(self.layer_index, write_at, k, v)
            k, v = cache.read(self.layer_index, kv_len)  # [B, KV, S, D]
        out = attention(q, k.to(q.dtype), v.to(q.dtype), mask).to(x.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, heads * head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [B, T, H] -> [B, T, H]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache, write_at, kv_len, mask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, write_at, kv_len, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # The layer-by-layer loaders build the model on the meta device and fill it. There,
        # normal_ and arange run torch's Python reference ops, whose first use imports
        # torch._dynamo (~2.5 s of a cached load): skip the random init, build the table on the CPU.
        on_meta = torch.get_default_device().type == "meta"
        embedding = torch.empty(config.vocab_size, config.hidden_size) if on_meta else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        with torch.device("cpu") if on_meta else contextlib.nullcontext():
            inv_freq = rope_inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rope_cache: tuple[Tensor, Tensor] | None = None
        self.fused_plan: fused_cpu.FusedStack | bool | None = None  # False = none; None = not looked at
        self.kv_dtype_choice = "auto"  # the fused layers' KV cache: auto, float32, float16 (fused_cpu.kv_dtype)

    @property
    def kv_dtype(self) -> torch.dtype:
        """Dtype of this model's KV caches. int4 on a CPU: where the fused layers run, float16
        or float32 as `kv_dtype_choice` says (their attention widens float16 to float32 and
        gives a row the same bits in any pass, models/fused_cpu.py), else float64, where the
        Python layers' attention runs (see Attention.forward). Otherwise the weights' dtype."""
        if any(layer.self_attn.float64_attention for layer in self.layers):
            if not self.fused_layers():
                return torch.float64
            return fused_cpu.kv_dtype(self.kv_dtype_choice, self.layers[0].self_attn.head_dim)
        return self.norm.weight.dtype

    # ---- rotary tables -------------------------------------------------------------------
    def rope_tables(self, length: int) -> tuple[Tensor, Tensor]:
        """cos, sign-folded sin [length, D] for positions 0..length-1, grown on demand.

        The sin table is negated on its first half so that rotate_half(x) * sin equals
        roll(x, D/2) * table, one op instead of four.
        """
        dtype = self.norm.weight.dtype
        cached = self._rope_cache
        if cached is None or cached[0].shape[0] < length or cached[0].dtype != dtype:
            size = max(length, 2048)
            angles = torch.outer(torch.arange(size, dtype=torch.float32), self.inv_freq.float().cpu())
            angles = torch.cat((angles, angles), dim=-1).to(self.inv_freq.device)
            half = angles.shape[-1] // 2
            sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(angles.device)
            self._rope_cache = (angles.cos().to(dtype), (angles.sin() * sign).to(dtype))
        return self._rope_cache

    # ---- forward -------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        positions: Tensor | None = None,  # [B, T]; default 0..T-1 (no cache) or write_at + 0..T-1
        cache: KVCache | None = None,
        write_at: int | Tensor = 0,  # cache slots of the new tokens: int start or [B, T]
        attn_mask: Tensor | None = None,  # [B, T, S] bool, True = may attend; S = kv_len
        kv_len: int | None = None,  # cache slots visible to attention; default write_at + T
        tap_layers: Sequence[int] = (),  # boundary ids: k = residual entering layer k (0 = embeddings)
        logits_at: Tensor | str | None = "all",  # "all", "last", None, or row indices [T_sel]
        input_embeds: Tensor | None = None,  # [B, T, H] instead of input_ids
        skip_layers: Collection[int] = (),  # decoder layers (0-based) to leave out: layer-skip drafts
        greedy: bool = False,  # only each row's argmax will be read (see output_logits)
        sequences: Tensor | None = None,  # [N]: a ragged pass (see below)
    ) -> ForwardOutput:
        """A ragged pass gives `sequences` [N], the KV cache row of each query, with
        input_ids, positions and write_at [1, N] and attn_mask [1, N, kv_len] (each query's
        visible slots in its own cache row): queries of any number of sequences, each with its
        own count, no padding. Its outputs are [1, N, ...] like a pass of one row."""
        if any(not 0 <= k <= len(self.layers) for k in tap_layers):
            raise ValueError(f"tap_layers {tuple(tap_layers)}: each must be a boundary id 0 .. "
                             f"{len(self.layers)} (k = the residual entering layer k, "
                             f"{len(self.layers)} = the last layer's output)")
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [B, T, H]
        batch, length = x.shape[:2]
        plan = self._fused(cache, x)
        if sequences is not None:
            if cache is None or positions is None or attn_mask is None or isinstance(write_at, int) \
                    or kv_len is None or batch != 1:
                raise ValueError("a ragged pass takes input_ids, positions and write_at [1, N], "
                                 "attn_mask [1, N, kv_len], kv_len and a cache")
            if not plan:  # the Python layers: one query per batch element
                return self._ragged_python(x, positions, cache, write_at, attn_mask, kv_len, tap_layers,
                                           logits_at, skip_layers, greedy, sequences)
        # 1. Positions, visible slots and the attention mask.
        if positions is None:
            start = write_at if isinstance(write_at, int) and cache is not None else 0
            positions = torch.arange(start, start + length, device=x.device).expand(batch, length)
        if cache is None:
            kv_len = length
        elif kv_len is None:
            if not isinstance(write_at, int):
                raise ValueError("kv_len is required when write_at is a tensor of slots")
            kv_len = write_at + length
        if attn_mask is None and length > 1:
            offset = kv_len - length  # queries occupy the last `length` slots: causal
            attn_mask = torch.ones(length, kv_len, dtype=torch.bool, device=x.device).tril(offset)
            attn_mask = attn_mask.expand(batch, length, kv_len)
        mask = attn_mask[:, None] if attn_mask is not None else None  # [B, 1, T, S]
        cos_table, sin_table = self.rope_tables(int(positions.max()) + 1)
        cos, sin = cos_table[positions][:, :, None], sin_table[positions][:, :, None]  # [B, T, 1, D]
        # 2. The decoder stack, collecting the taps on the way.
        tap_tensor = None
        if plan:  # int4 on a CPU: the fused stack (models/fused_cpu.py), rows flattened, one C++ call
            x = x.reshape(batch * length, -1).contiguous()
            cos, sin = cos.reshape(batch * length, -1), sin.reshape(batch * length, -1)
            slots = (torch.arange(write_at, write_at + length).expand(batch, length).contiguous()
                     if isinstance(write_at, int) else write_at.long().contiguous())
            if attn_mask is not None:
                attn_mask = attn_mask.expand(batch, length, kv_len)
            run = [index for index in range(len(self.layers)) if index not in skip_layers]
            # the residual entering model layer k enters run[p], p = the run's layers before k
            tap_before = [bisect.bisect_left(run, k) for k in tap_layers]
            if tap_layers:
                tap_tensor = x.new_empty(batch * length, len(tap_layers), x.shape[1])  # [N, K, H]
            x = plan.run(x, cos, sin, cache, run, slots, kv_len, attn_mask, sequences, tap_before, tap_tensor)
            x = x.view(batch, length, -1)
            if tap_tensor is not None:
                tap_tensor = tap_tensor.view(batch, length, -1)  # [B, T, K * H] in tap_layers' order
        else:
            taps: list[Tensor] = []
            wanted = set(tap_layers)
            for index, layer in enumerate(self.layers):
                if index in wanted:
                    taps.append(x)
                if index not in skip_layers:
                    x = layer(x, cos, sin, cache, write_at, kv_len, mask)
            if len(self.layers) in wanted:
                taps.append(x)
            if tap_layers:
                by_layer = dict(zip(sorted(wanted), taps))
                tap_tensor = torch.cat([by_layer[k] for k in tap_layers], dim=-1)
        hidden = plan.final_norm(x, self.norm) if plan else self.norm(x)
        return ForwardOutput(logits=self._logits_at(hidden, logits_at, greedy), hidden=hidden, taps=tap_tensor)

    def decode_one(self, token: int, position: int, cache: KVCache,
                   tap_layers: Sequence[int] = ()) -> ForwardOutput | None:
        """`decode_rows` for one token at `position`, written at slot `position` (a
        single-stream plain step: it sees slots [0, position], no mask)."""
        return self.decode_rows([token], [position], position, None, cache, tap_layers)

    def decode_rows(self, tokens: Sequence[int], positions: Sequence[int], first_slot: int,
                    mask: Tensor | None, cache: KVCache, tap_layers: Sequence[int] = ()) -> ForwardOutput | None:
        """`forward` for T tokens of one sequence on the fused stack (a single-stream step:
        its root, and its draft tree when it has one), with the same C++ code on the same
        inputs, so the same bits: tokens [T] at `positions` [T], written at slots first_slot..,
        mask [1, T, first_slot + T] bool or None (T = 1: every slot up to its own). Python ints
        in, no logits (the caller's output layer). None where the fused stack does not run
        this pass (then `forward`). One C++ call gathers the inputs, runs the layers and the
        final norm: the generic path's small ops (embedding lookup, positions, rotary rows,
        slots, the norm) ran cold after each pass, ~0.2 ms a step on AMD Zen 4."""
        count = len(tokens)
        if count == 0 or (mask is None and count > 1):
            return None
        embedding = self._embedding_rows(tokens)
        if embedding is None:
            return None
        table, ids = embedding
        plan = self._fused(cache, table)
        if not plan or any(not 0 <= k <= len(self.layers) for k in tap_layers):
            return None
        cos_table, sin_table = self.rope_tables(max(positions) + 1)
        out = plan.decode(ids, positions, first_slot, table, cos_table, sin_table, cache, mask,
                          list(tap_layers), self.norm)
        if out is None:
            return None
        return ForwardOutput(logits=None, hidden=out[0], taps=out[1] if tap_layers else None)

    def _embedding_rows(self, tokens: Sequence[int]) -> tuple[Tensor, Sequence[int]] | None:
        """What `decode_rows`' C++ call gathers its input rows from: the float32 embedding
        table [V, H] and the tokens, or, for an embedding read from the checkpoint row by row
        (models/source_embedding.py, its float32 table never built here), the tokens' own
        rows [T, H] and 0..T-1. None where neither applies (then `forward`, which also
        raises for a token out of range)."""
        embed = self.embed_tokens
        if isinstance(embed, nn.Embedding):
            table = embed.weight
            return (table, tokens) if table.dtype == torch.float32 else None
        if not hasattr(embed, "rows") or not hasattr(embed, "has_table"):
            return None
        if embed.has_table:
            return embed.weight, tokens
        if min(tokens) < 0 or max(tokens) >= embed.num_embeddings:
            return None
        return torch.from_numpy(embed.rows(np.asarray(tokens, dtype=np.int64))), list(range(len(tokens)))

    def greedy_tokens(self, hidden: Tensor) -> list[int]:
        """Each row's argmax of `output_logits(hidden, greedy=True)` (hidden [..., H]), as
        Python ints: in one C++ call where the output layer screens (no logits come out),
        else torch.argmax's (the first of equal maxima)."""
        if hasattr(self.lm_head, "greedy_tokens"):
            return self.lm_head.greedy_tokens(hidden)
        return self.output_logits(hidden, greedy=True).argmax(dim=-1).reshape(-1).tolist()

    def _logits_at(self, hidden: Tensor, logits_at: Tensor | str | None, greedy: bool) -> Tensor | None:
        """3. The output layer, only where asked (it is the widest matmul of a small model)."""
        if isinstance(logits_at, str):
            if logits_at == "all":
                return self.output_logits(hidden, greedy)
            if logits_at == "last":
                return self.output_logits(hidden[:, -1:], greedy)
            raise ValueError(f"logits_at must be 'all', 'last', None or a tensor, not {logits_at!r}")
        if logits_at is not None:
            return self.output_logits(hidden[:, logits_at], greedy)
        return None

    def _ragged_python(self, x: Tensor, positions: Tensor, cache: KVCache, write_at: Tensor,
                       attn_mask: Tensor, kv_len: int, tap_layers: Sequence[int],
                       logits_at: Tensor | str | None, skip_layers: Collection[int], greedy: bool,
                       sequences: Tensor) -> ForwardOutput:
        """A ragged pass (x [1, N, H]) through the Python layers: a dense pass of N elements of
        one query each, element n reading and writing KV row sequences[n] (kv_cache.RowsView)."""
        count = x.shape[1]
        out = self.forward(None, positions.reshape(count, 1), cache=RowsView(cache, sequences),
                           write_at=write_at.reshape(count, 1), attn_mask=attn_mask.reshape(count, 1, kv_len),
                           kv_len=kv_len, tap_layers=tap_layers, logits_at=None,
                           input_embeds=x.reshape(count, 1, -1), skip_layers=skip_layers)
        hidden = out.hidden.reshape(1, count, -1)  # [1, N, H]
        taps = out.taps.reshape(1, count, -1) if out.taps is not None else None
        return ForwardOutput(logits=self._logits_at(hidden, logits_at, greedy), hidden=hidden, taps=taps)

    def fused_layers(self) -> fused_cpu.FusedStack | None:
        """The fused C++ layers of an int4 model on a CPU (models/fused_cpu.py), or None."""
        if self.fused_plan is None:
            self.fused_plan = fused_cpu.fused_layers(self) or False
        return self.fused_plan or None

    def _fused(self, cache: KVCache | None, x: Tensor) -> list | None:
        """The fused layers where this pass may use them: a float32, float64 or float16 KV
        cache, float32 activations, no autograd. A float16 cache has no other path."""
        if cache is None or cache.keys.dtype not in (torch.float32, torch.float64, torch.float16):
            return None
        plan = self.fused_layers()
        if plan is None:
            return None  # e.g. a float16 model's own float16 cache: the Python layers
        if x.dtype == torch.float32 and not torch.is_grad_enabled():
            return plan
        if cache.keys.dtype == torch.float16:
            raise RuntimeError("a float16 KV cache (--kv-dtype float16) is read by the fused int4 "
                               "layers only: float32 activations, no autograd")
        return None

    def output_logits(self, hidden: Tensor, greedy: bool = False) -> Tensor:  # [..., H] -> [..., V]
        """The output layer. greedy=True allows a layer that finds each row's argmax exactly
        without computing every logit exactly (ScreenedOutputLayer): then read nothing but
        the argmax of the result."""
        if greedy and hasattr(self.lm_head, "greedy_logits"):
            return self.lm_head.greedy_logits(hidden)
        return self.lm_head(hidden)

    # ---- weights -------------------------------------------------------------------------
    def load_hf_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load Hugging Face parameter names, fusing q/k/v and gate/up on the way."""
        prefix = "model." if any(name.startswith("model.") for name in state) else ""
        own: dict[str, Tensor] = {"embed_tokens.weight": state[f"{prefix}embed_tokens.weight"]}
        own["norm.weight"] = state[f"{prefix}norm.weight"]
        if not self.config.tie_word_embeddings:
            own["lm_head.weight"] = state.get("lm_head.weight", own["embed_tokens.weight"])
        for i in range(self.config.num_hidden_layers):
            src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            own[dst + "self_attn.qkv_proj.weight"] = torch.cat(
                [state[attn + f"{p}_proj.weight"] for p in "qkv"], dim=0
            )
            if self.config.attention_bias:
                own[dst + "self_attn.qkv_proj.bias"] = torch.cat(
                    [state[attn + f"{p}_proj.bias"] for p in "qkv"], dim=0
                )
            own[dst + "self_attn.o_proj.weight"] = state[attn + "o_proj.weight"]
            if self.config.qk_norm:
                own[dst + "self_attn.q_norm.weight"] = state[attn + "q_norm.weight"]
                own[dst + "self_attn.k_norm.weight"] = state[attn + "k_norm.weight"]
            own[dst + "mlp.gate_up_proj.weight"] = torch.cat(
                [state[src + "mlp.gate_proj.weight"], state[src + "mlp.up_proj.weight"]], dim=0
            )
            own[dst + "mlp.down_proj.weight"] = state[src + "mlp.down_proj.weight"]
            for norm in ("input_layernorm", "post_attention_layernorm"):
                own[dst + f"{norm}.weight"] = state[src + f"{norm}.weight"]
        missing, unexpected = self.load_state_dict(own, strict=False)
        self.fused_plan = None
        missing = [m for m in missing if not (m == "lm_head.weight" and self.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
        self._rope_cache = None
