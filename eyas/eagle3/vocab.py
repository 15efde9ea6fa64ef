"""The draft vocabulary: the N target tokens the head can propose, as `d2t` and `t2d`.

Count target tokens where `loss_mask == 1` over the training set; keep the top N by frequency
(ties broken by the smaller token id), padded with unused ids when fewer than N occur; sort the
kept ids. Then

    d2t[i] = kept[i] - i        int64 [N]   OFFSETS: target_id = draft_id + d2t[draft_id]
    t2d[v] = v in kept          bool  [V]

Usage:
    counts = count_answer_tokens(samples, vocab_size)     # samples: (input_ids, loss_mask) pairs
    vocab = build_draft_vocab(counts, draft_vocab_size=32000)
    vocab.coverage(counts)   # share of answer tokens the head can propose at all
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor

from eyas.errors import EyasError


@dataclass
class DraftVocab:
    d2t: Tensor  # int64 [N] offsets
    t2d: Tensor  # bool [V]

    def __post_init__(self) -> None:
        kept = self.kept_ids
        assert self.d2t.dtype == torch.int64 and self.t2d.dtype == torch.bool
        assert int(self.t2d.sum()) == self.d2t.numel() and bool(self.t2d[kept].all())

    @property
    def kept_ids(self) -> Tensor:
        """Target id of each draft id: [N], strictly increasing."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @property
    def size(self) -> int:
        return self.d2t.numel()

    def coverage(self, counts: Tensor) -> float:
        """Fraction of the counted answer tokens that lie inside the draft vocabulary."""
        total = int(counts.sum())
        return float(counts[self.t2d].sum()) / total if total else 0.0


def count_answer_tokens(samples: Iterable[tuple[Tensor, Tensor]], vocab_size: int) -> Tensor:
    """Frequency [V] of each token where loss_mask == 1 (input_ids [T], loss_mask [T])."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for input_ids, loss_mask in samples:
        answer = input_ids[loss_mask.bool()].long()
        outside = answer[(answer < 0) | (answer >= vocab_size)]
        if outside.numel():
            raise EyasError(
                f"token id {int(outside[0])} is outside the target vocabulary (0..{vocab_size - 1}): "
                f"were the conversations tokenized with this target's tokenizer?"
            )
        counts += torch.bincount(answer, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: Tensor, draft_vocab_size: int) -> DraftVocab:
    """Top-N ids by count (ties: smaller id first; unused ids pad), as d2t offsets and t2d."""
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise EyasError(
            f"draft_vocab_size must be in 1..{vocab_size} (the target vocabulary), "
            f"got {draft_vocab_size}"
        )
    # A stable sort on -count keeps ascending ids among equal counts, zero counts included:
    # the unused ids that pad a small data set are the smallest unused ids.
    order = torch.sort(-counts.long(), stable=True).indices
    kept = torch.sort(order[:draft_vocab_size]).values  # [N] ascending target ids
    d2t = kept - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return DraftVocab(d2t=d2t.to(torch.int64), t2d=t2d)


def vocab_from_d2t(d2t: Tensor, vocab_size: int) -> DraftVocab:
    """Rebuild the pair from stored offsets (checks that they describe a valid mapping)."""
    kept = torch.arange(d2t.numel()) + d2t.long()
    if d2t.numel() and (int(kept.min()) < 0 or int(kept.max()) >= vocab_size
                        or bool((kept[1:] <= kept[:-1]).any())):
        raise EyasError("d2t does not map draft ids to increasing target ids inside the vocabulary")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return DraftVocab(d2t=d2t.long(), t2d=t2d)
