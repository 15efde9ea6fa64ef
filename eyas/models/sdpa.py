"""Scaled dot-product attention with no per-shape planning on CUDA: the one call site of
`F.scaled_dot_product_attention` for the target's layers and the EAGLE-3 head.

Usage:
    out = attention(q, k, v, mask)  # q [B, Hq, T, D], k/v [B, KV, S, D], mask [B, 1, T, S] bool

On a GPU, PyTorch prefers cuDNN's attention for bfloat16 and float16, and cuDNN builds an
execution plan for every new shape: ~70-90 ms of host time each on an H200 (torch 2.11), and
the shapes here change all the time (a training micro batch's length, an engine pass's KV
length). Measured there, it was 95% of the wall time of an EAGLE-3 training step whose GPU work
took 44 ms. The flash, memory-efficient and math kernels need no plan; on CUDA the call keeps to
them. On a CPU nothing changes.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

WITHOUT_PLANS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(D) + mask) v with grouped-query heads ([B, Hq, T, D])."""
    if q.is_cuda:
        with sdpa_kernel(WITHOUT_PLANS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
