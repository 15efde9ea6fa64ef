"""Draft vocabulary: d2t offsets and t2d from a hand-made count table."""

from __future__ import annotations

import pytest
import torch

from eyas.eagle3.vocab import build_draft_vocab, count_answer_tokens, vocab_from_d2t
from eyas.errors import EyasError


def test_top_n_offsets_on_a_hand_made_count_table() -> None:
    #                       id: 0  1  2  3  4  5  6  7
    counts = torch.tensor([0, 5, 1, 9, 5, 0, 2, 7])
    vocab = build_draft_vocab(counts, draft_vocab_size=4)
    # top 4 by count: 3 (9), 7 (7), 1 (5), 4 (5; tie with 1 broken by the smaller id) -> sorted
    assert vocab.kept_ids.tolist() == [1, 3, 4, 7]
    assert vocab.d2t.tolist() == [1 - 0, 3 - 1, 4 - 2, 7 - 3]
    assert vocab.d2t.dtype == torch.int64
    assert vocab.t2d.tolist() == [False, True, False, True, True, False, False, True]
    assert vocab.t2d.dtype == torch.bool
    # target_id = draft_id + d2t[draft_id]
    draft_ids = torch.arange(4)
    assert (draft_ids + vocab.d2t[draft_ids]).tolist() == [1, 3, 4, 7]
    assert vocab.coverage(counts) == pytest.approx((5 + 9 + 5 + 7) / 29)


def test_ties_go_to_the_smaller_id() -> None:
    counts = torch.tensor([3, 3, 3, 3])
    assert build_draft_vocab(counts, 2).kept_ids.tolist() == [0, 1]


def test_fewer_used_tokens_than_n_pads_with_the_smallest_unused_ids() -> None:
    counts = torch.tensor([0, 0, 4, 0, 1, 0])
    vocab = build_draft_vocab(counts, draft_vocab_size=4)
    assert vocab.kept_ids.tolist() == [0, 1, 2, 4]  # used 2, 4; padded with unused 0, 1
    assert vocab.d2t.tolist() == [0, 0, 0, 1]


def test_counts_only_answer_tokens() -> None:
    ids = torch.tensor([5, 5, 1, 2, 2, 2])
    mask = torch.tensor([1, 1, 0, 0, 1, 0])
    counts = count_answer_tokens([(ids, mask)], vocab_size=8)
    assert counts.tolist() == [0, 0, 1, 0, 0, 2, 0, 0]


def test_bad_sizes_and_ids_are_refused() -> None:
    with pytest.raises(EyasError, match="draft_vocab_size must be in 1..4"):
        build_draft_vocab(torch.zeros(4, dtype=torch.int64), 5)
    with pytest.raises(EyasError, match="outside the target vocabulary"):
        count_answer_tokens([(torch.tensor([9]), torch.tensor([1]))], vocab_size=8)
    with pytest.raises(EyasError, match="token id -2 is outside"):  # the bad id, not the largest
        count_answer_tokens([(torch.tensor([7, -2, 3]), torch.tensor([1, 1, 1]))], vocab_size=8)
    with pytest.raises(EyasError, match="increasing target ids"):
        vocab_from_d2t(torch.tensor([3, 1]), vocab_size=8)  # maps to 3, 2: not increasing


def test_rebuilding_t2d_from_d2t() -> None:
    vocab = build_draft_vocab(torch.tensor([0, 5, 1, 9, 5, 0, 2, 7]), 4)
    rebuilt = vocab_from_d2t(vocab.d2t, 8)
    assert torch.equal(rebuilt.t2d, vocab.t2d)
