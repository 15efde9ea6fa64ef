"""The Medusa training loss: K heads on the target's last hidden states, against the target's own
next-token distributions.

Alignment (tokens x_0..x_{T-1}; h_t = the target's last hidden state at t, which predicts x_{t+1};
head k = 1..K):

    head k, row t:  input   = h_t
                    target  = softmax(target logits of row t + k) over the draft vocabulary
                              (the target's distribution of x_{t+1+k})
                    weight  = loss_mask[t + 1 + k] * (the target's argmax at row t + k is drafted)

Head k is aligned as TTT step k - 1 of EAGLE-3 (training/ttt.py): same target rows, weights,
normalizer (answer rows of head 1) and metrics (loss_{k-1}, acc_{k-1}; the trainer's
accept_length = 1 + sum_k prod_{i<=k} acc_i is then the estimate for a chain of top-1 guesses).

    loss_k = -sum_rows weight * sum_v p_v log q_v        (a sum; the trainer normalizes it)
    loss   = sum_k decay^(k-1) loss_k / (answer tokens in the global batch)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from eyas.medusa.head import MedusaHeads
from eyas.training.ttt import TargetDistribution, TTTResult, score_rows, shift_left


class MedusaLoss(nn.Module):
    """All K heads over every row as one module (DDP sees one forward per backward)."""

    def __init__(self, heads: MedusaHeads) -> None:
        super().__init__()
        self.heads = heads

    def forward(
        self,
        hidden: Tensor,  # [B, T, H] the target's last hidden states (after its final norm)
        loss_mask: Tensor,  # [B, T] 0/1
        target: TargetDistribution,  # probs [B, T, N]: row t -> x_{t+1}
    ) -> TTTResult:
        states = self.heads.head_states(hidden)  # [B, T, K, H]
        loss_sums, correct, counted = [], [], []
        for k in range(1, self.heads.config.num_heads + 1):
            # 1. Rows whose head-k token x_{t+1+k} is an answer token.
            answer = shift_left(loss_mask, k + 1).bool()  # [B, T]
            rows, times = answer.nonzero(as_tuple=True)  # [M] each
            target_times = times + k
            # 2. Logits only at those rows (the output layer is the widest matmul).
            logits = self.heads.compute_logits(states[rows, times, k - 1])  # [M, N]
            loss_sum, hits = score_rows(logits, target, rows, target_times)
            loss_sums.append(loss_sum)
            correct.append(hits)
            counted.append(answer.sum())
        return TTTResult(loss_sums=torch.stack(loss_sums), correct=torch.stack(correct),
                         counted=torch.stack(counted))
