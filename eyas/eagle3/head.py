"""`Eagle3Head`: the EAGLE-3 draft head, one class for training and for the engine.

    taps [B, T, 3*Ht] --fc--> f [B, T, H]          (step 0: fused target feature)
                           or h [B, T, H]          (later steps: the head's own pre-norm output)
    x = cat(input_layernorm(embed(ids)), hidden_norm(f))      [B, T, 2H]
    f = f + o_proj(attention(q/k/v_proj(x)))                   residual = the un-normed feature
    f = f + mlp(post_attention_layernorm(f))                   -> pre-norm output [B, T, H]
    logits = lm_head(norm(f))                                  [B, T, N] over the draft vocabulary

Module names are the ones SGLang and vLLM load (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`), so the eyas checkpoint and the SGLang export hold the same tensors. The token embedding
is the target's, shared and frozen; it is not saved unless asked.

Engine usage (one draft step over rows at explicit positions with an external KV state):
    head = load_head(folder, embedding=target.model.embed_tokens.weight)
    out = head(taps, input_ids, positions)                    # prefill: causal over T rows
    out = head(out.hidden[:, -1:], next_ids, positions + 1,   # one step on: its own output
               attn_mask=mask, past_kv=out.past_kv)          # mask [B, T, S_past + T] bool
    draft_ids = head.draft_to_target(out.logits.argmax(-1))   # draft ids -> target ids

Position convention: the row that holds the target feature of position p and the token of
position p + 1 has position p (as in vLLM and SGLang); step k of a chain is position p + k.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.eagle3.config import Eagle3Config
from eyas.eagle3.vocab import DraftVocab
from eyas.models.llama import rope_inverse_frequencies
from eyas.models.quant import Int4Linear
from eyas.models.sdpa import attention


def rotate_half(x: Tensor) -> Tensor:  # [..., D]: (x1, x2) -> (-x2, x1)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 whatever the input dtype (bf16 autocast included)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., D]
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class DraftStepOutput(NamedTuple):
    logits: Tensor | None  # [B, T, N] draft-vocabulary logits (None if not asked for)
    hidden: Tensor  # [B, T, H] pre-norm output: the `hidden` input of the next draft step
    past_kv: tuple[Tensor, Tensor]  # keys, values [B, KV, S_past + T, D]


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size  # attention reads cat(norm(embedding), norm(hidden))
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: Tensor,  # [B, T, 2H]
        cos: Tensor,  # [B, 1, T, D]
        sin: Tensor,  # [B, 1, T, D]
        mask: Tensor | None,  # [B, 1, T, S] bool, True = may attend; None = attend to all
        past_kv: tuple[Tensor, Tensor] | None,  # [B, KV, S_past, D] each
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin  # [B, Hq, T, D]
        k = k * cos + rotate_half(k) * sin  # [B, KV, T, D]
        if past_kv is not None:
            k = torch.cat([past_kv[0].to(k.dtype), k], dim=2)  # [B, KV, S, D]
            v = torch.cat([past_kv[1].to(v.dtype), v], dim=2)
        out = attention(q, k, v, mask)
        out = out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self.o_proj(out), (k, v)


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [B, T, H] -> [B, T, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on embeddings
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on the feature
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)

    def forward(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor,
                mask: Tensor | None, past_kv: tuple[Tensor, Tensor] | None
                ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        # embeds, hidden: [B, T, H]
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, new_kv = self.self_attn(x, cos, sin, mask, past_kv)
        hidden = hidden + attn  # residual = the un-normed feature (norm_before_residual: false)
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, new_kv


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.requires_grad_(False)
        self.embedding_set = False  # the target's embedding must be shared before use
        self.fc = nn.Linear(config.fused_input_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True  # placeholder until a vocabulary is loaded
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", t2d)
        self._inv_freq: dict[torch.device, Tensor] = {}

    @property
    def dtype(self) -> torch.dtype:
        """Activations' dtype (the norms stay float even where the linears are int4)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def precision(self) -> str:
        """The weights' precision: int4 once the linears are Int4Linear (quantize_linears, for
        an int4 target), else the dtype's name."""
        quantized = any(isinstance(m, Int4Linear) for m in self.modules())
        return "int4" if quantized else str(self.dtype).removeprefix("torch.")

    # ---- set-up ----------------------------------------------------------------------------
    def set_embedding(self, weight: Tensor) -> None:
        """Share the target's token embedding [V, H] (frozen; no copy when dtype/device match)."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"target embedding has shape {tuple(weight.shape)}, the head expects "
                f"({self.config.vocab_size}, {self.config.hidden_size})"
            )
        self.embed_tokens.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.embedding_set = True

    def set_vocab(self, vocab: DraftVocab) -> None:
        if vocab.size != self.config.draft_vocab_size or vocab.t2d.numel() != self.config.vocab_size:
            raise ValueError(
                f"vocabulary of {vocab.size}/{vocab.t2d.numel()} ids does not fit a head of "
                f"{self.config.draft_vocab_size}/{self.config.vocab_size}"
            )
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    @property
    def draft_vocab(self) -> DraftVocab:
        return DraftVocab(d2t=self.d2t.cpu(), t2d=self.t2d.cpu())

    # ---- pieces the engine may call on their own ---------------------------------------------
    def fuse(self, taps: Tensor) -> Tensor:
        """[B, T, 3*Ht] concatenated target taps -> [B, T, H] fused feature."""
        return self.fc(taps)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[B, T, H] pre-norm output -> [B, T, N] draft-vocabulary logits."""
        return self.lm_head(self.norm(hidden))

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids (any shape) -> target ids of the same shape."""
        return draft_ids + self.d2t[draft_ids]

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [B, 1, T, D] for positions [B, T]."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = rope_inverse_frequencies(self.config).to(positions.device)  # type: ignore[arg-type]
            self._inv_freq[positions.device] = inv_freq
        angles = positions[..., None].float() * inv_freq  # [B, T, D/2]
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, T, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    # ---- one draft step ------------------------------------------------------------------------
    def forward(
        self,
        hidden: Tensor,  # [B, T, 3*Ht] fused target taps (goes through fc) or [B, T, H] own output
        input_ids: Tensor,  # [B, T] target token ids (the token one position after the feature)
        positions: Tensor,  # [B, T]
        attn_mask: Tensor | None = None,  # [B, T, S_past + T] or [T, S_past + T] bool; None = causal
        past_kv: tuple[Tensor, Tensor] | None = None,  # keys, values [B, KV, S_past, D]
        compute_logits: bool = True,
    ) -> DraftStepOutput:
        if not self.embedding_set:
            raise RuntimeError(
                "the head has no token embedding: share the target's with "
                "head.set_embedding(target.model.embed_tokens.weight) or load_head(..., embedding=...)"
            )
        width = hidden.shape[-1]
        if width == self.config.fused_input_size:
            hidden = self.fc(hidden)
        elif width != self.config.hidden_size:
            raise ValueError(
                f"hidden has width {width}; expected {self.config.fused_input_size} (three target "
                f"taps) or {self.config.hidden_size} (the head's own output)"
            )
        length = input_ids.shape[1]
        past_length = 0 if past_kv is None else past_kv[0].shape[2]
        mask = attn_mask
        if mask is None and length > 1:  # causal over the new rows, all of the past visible
            total = past_length + length
            mask = torch.ones(length, total, dtype=torch.bool, device=hidden.device).tril(past_length)
        if mask is not None:
            mask = mask[None, None] if mask.dim() == 2 else mask[:, None]  # [B|1, 1, T, S]
        embeds = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rope(positions, hidden.dtype)
        hidden, new_kv = self.midlayer(embeds, hidden, cos, sin, mask, past_kv)
        logits = self.compute_logits(hidden) if compute_logits else None
        return DraftStepOutput(logits=logits, hidden=hidden, past_kv=new_kv)
