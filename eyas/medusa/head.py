"""`MedusaHeads`: K Medusa heads, one class for training and for the engine.

    hidden [B, T, H]   the target's last hidden state (after its final norm) at position t
    s_k = block_k(hidden)                  block = num_layers x (x + SiLU(W x + b)), k = 1..K
    logits_k = output(s_k)                 [B, T, N]: head k's guess at token t + 1 + k

`output` is the target's own lm_head (shared, frozen, not saved; N = V), or one trained output
layer over a draft vocabulary of N target ids shared by the K heads (stored with `d2t`/`t2d`,
the EAGLE-3 convention: target_id = draft_id + d2t[draft_id]). A block's W starts at zero, so a
new head starts by repeating the target's own next-token guess (Medusa-1's initialisation).

Engine usage:
    heads = load_medusa(folder)                       # checkpoint.py
    heads.set_output_layer(target.model.lm_head)      # only when heads.config.shares_target_output
    logits = heads(hidden_at_last_position[None, None])[0, 0]     # [K, N]
    target_ids = heads.draft_to_target(logits.topk(4).indices)    # [K, 4]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.eagle3.vocab import DraftVocab
from eyas.medusa.config import MedusaConfig


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: Tensor) -> Tensor:  # [..., H] -> [..., H]
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads))
        self.lm_head: nn.Module | None = None
        if not config.shares_target_output:
            self.lm_head = nn.Linear(config.hidden_size, config.output_size, bias=False)
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[: config.output_size] = True  # placeholder until a vocabulary is set
            self.register_buffer("d2t", torch.zeros(config.output_size, dtype=torch.int64))
            self.register_buffer("t2d", t2d)

    # ---- set-up ----------------------------------------------------------------------------
    def set_output_layer(self, layer: nn.Module) -> None:
        """Share the target's output layer (`Linear` or the engine's transposed one), frozen."""
        if not self.config.shares_target_output:
            raise ValueError("these heads train their own output layer over a draft vocabulary")
        self.lm_head = layer.requires_grad_(False)

    def set_vocab(self, vocab: DraftVocab) -> None:
        if self.config.shares_target_output:
            return  # draft ids are target ids
        if vocab.size != self.config.output_size or vocab.t2d.numel() != self.config.vocab_size:
            raise ValueError(f"vocabulary of {vocab.size}/{vocab.t2d.numel()} ids does not fit heads "
                             f"of {self.config.output_size}/{self.config.vocab_size}")
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids (any shape) -> target ids of the same shape."""
        return draft_ids if self.config.shares_target_output else draft_ids + self.d2t[draft_ids]

    # ---- forward ---------------------------------------------------------------------------
    def head_states(self, hidden: Tensor) -> Tensor:
        """[..., H] target hidden states -> [..., K, H] the K heads' states."""
        return torch.stack([block(hidden) for block in self.blocks], dim=-2)

    def compute_logits(self, states: Tensor) -> Tensor:
        """[..., H] head states -> [..., N] logits."""
        if self.lm_head is None:
            raise RuntimeError("these heads share the target's output layer: call "
                               "heads.set_output_layer(target.model.lm_head) first")
        return self.lm_head(states)

    def forward(self, hidden: Tensor) -> Tensor:
        """[B, T, H] -> logits [B, T, K, N]; head k (index k - 1) guesses token t + 1 + k."""
        return self.compute_logits(self.head_states(hidden))
