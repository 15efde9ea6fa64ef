"""The statistics of the head diagnosis, on plain tensors (no model): coverage, peakedness,
accuracy by the target's confidence, the acceptance-length estimate.

Usage:
    position_coverage(greedy_tokens, vocab)        # share of positions the head could draft at all
    peak = peakedness(logits)                       # peak.share_below, peak.mean_top1
    by_confidence(hits, top1)                       # first-step accuracy per top-1 bucket
    accept_length([0.4, 0.35, 0.3])                 # 1 + sum_k prod_{i<=k} acc_i
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from eyas.eagle3.vocab import DraftVocab

# Bucket edges of the target's top-1 probability (the first bucket starts at 0, the last ends at 1).
CONFIDENCE_EDGES = (0.3, 0.5, 0.8)


def position_coverage(tokens: Tensor, vocab: DraftVocab) -> float:
    """Share of positions whose token (the target's greedy choice, int64 [N]) lies inside the
    draft vocabulary: the most a head with this vocabulary can ever get right at those positions."""
    if tokens.numel() == 0:
        return 0.0
    counts = torch.bincount(tokens.long(), minlength=vocab.t2d.numel())
    return vocab.coverage(counts)


@dataclass
class Peakedness:
    share_below: float  # share of positions whose top-1 probability is < threshold
    mean_top1: float  # mean top-1 probability
    threshold: float
    positions: int


def top1_probability(logits: Tensor) -> Tensor:
    """[N, V] logits -> [N] float32 probability of each row's most likely token."""
    return torch.softmax(logits.float(), dim=-1).max(dim=-1).values


def peakedness(logits: Tensor | None = None, top1: Tensor | None = None,
               threshold: float = 0.5) -> Peakedness:
    """How peaked the target is, from its logits [N, V] (or top-1 probabilities [N] already
    computed): where it is below `threshold`, even the target's own choice is a close call, and a
    head that reads the target's features cannot be expected to reproduce it reliably."""
    if top1 is None:
        assert logits is not None
        top1 = top1_probability(logits)
    if top1.numel() == 0:
        return Peakedness(0.0, 0.0, threshold, 0)
    return Peakedness(share_below=float((top1 < threshold).float().mean()),
                      mean_top1=float(top1.float().mean()), threshold=threshold,
                      positions=top1.numel())


def by_confidence(hits: Tensor, top1: Tensor, edges: Sequence[float] = CONFIDENCE_EDGES
                  ) -> list[dict[str, float | int | list[float]]]:
    """Accuracy of `hits` (bool [N]) within buckets of the target's top-1 probability (float [N]):
    [0, e1), [e1, e2), ..., [e_last, 1]. Each: range, positions, share of all, accuracy."""
    bounds = [0.0, *edges, 1.0]
    total = hits.numel()
    buckets = []
    for index, (low, high) in enumerate(zip(bounds, bounds[1:])):
        last = index == len(bounds) - 2  # the last bucket holds top-1 == 1 too
        inside = (top1 >= low) & ((top1 <= high) if last else (top1 < high))
        count = int(inside.sum())
        buckets.append({"range": [low, high], "positions": count,
                        "share": count / total if total else 0.0,
                        "accuracy": float(hits[inside].float().mean()) if count else 0.0})
    return buckets


def accept_length(accuracy_per_step: Sequence[float]) -> float:
    """The trainer's estimate of tokens per verification step for a chain of top-1 drafts:
    1 (the bonus token) + sum over k of the product of the accuracies of steps 0..k."""
    total, running = 1.0, 1.0
    for accuracy in accuracy_per_step:
        running *= accuracy
        total += running
    return total
