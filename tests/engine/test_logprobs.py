"""Token logprobs: log_softmax of the raw rows, the chosen token and the top alternatives."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.logprobs import token_logprobs


def test_entries_are_the_rows_log_softmax():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    entries = token_logprobs(logits, [2, 3], top=2)
    expected = torch.log_softmax(logits, dim=-1)
    assert [e.token for e in entries] == [2, 3]
    assert entries[0].logprob == approx(float(expected[0, 2]))
    assert entries[1].logprob == approx(float(expected[1, 3]))
    assert [t for t, _ in entries[0].top] == [1, 2]  # best first
    assert [t for t, _ in entries[1].top] == [2, 3]
    assert entries[0].top[0][1] == approx(float(expected[0, 1]))


def test_top_zero_gives_the_chosen_token_alone():
    entries = token_logprobs(torch.randn(3, 10), [0, 1, 2], top=0)
    assert all(e.top == [] for e in entries)
    assert token_logprobs(torch.randn(0, 10), [], top=3) == []


def approx(value):
    return pytest.approx(value, abs=1e-6)
