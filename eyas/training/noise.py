"""Noise on the target features a head is fed while training (EAGLE's data augmentation): the
head learns to draft from features a little off the target's, as its own outputs are at the
later steps of a draft.

    uniform:  x + U(-std, std)          gaussian:  x + N(0, std^2)          none: x

The noise of a micro batch is a function of (seed, step, micro batch) alone, so that a resumed
run draws the same noise as one that was never interrupted.

Usage:
    taps = add_feature_noise(taps, "uniform", 0.2, seed=0, step=12, micro_batch=0)
"""

from __future__ import annotations

import torch
from torch import Tensor


def add_feature_noise(features: Tensor, kind: str, std: float, seed: int, step: int,
                      micro_batch: int) -> Tensor:
    """features [B, T, F] plus noise of `kind` (a new tensor; `features` is not changed)."""
    if kind == "none" or std == 0.0:
        return features
    generator = torch.Generator(device=features.device)
    # distinct, fixed streams per (seed, step, micro batch)
    generator.manual_seed((seed * 1_000_003 + step) * 1_009 + micro_batch)
    features = features.float()
    if kind == "uniform":
        noise = torch.rand(features.shape, generator=generator, device=features.device)
        noise = (noise * 2.0 - 1.0) * std
    elif kind == "gaussian":
        noise = torch.randn(features.shape, generator=generator, device=features.device) * std
    else:
        raise ValueError(f"unknown feature noise '{kind}'; accepted: none, uniform, gaussian")
    return features + noise
