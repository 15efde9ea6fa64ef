"""A draft model's catch-up over a window (proposers/draft_model.py): a catch-up longer than
`catch_up_window` tokens restarts the draft's cache from the last tokens of the context, at
positions from 0; greedy output stays equal to plain."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
from spec_checks import assert_greedy_equals_plain

PROMPT = list(range(200, 240))  # 40 tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_long_catch_up_restarts_the_cache_from_a_window(tiny_target):
    proposer = DraftModelProposer(tiny_target, catch_up_window=8)
    proposer.begin(tiny_target, PROMPT, SamplingParams())  # unpriced: the prompt is not read
    assert proposer.cached_ids == []
    tree = proposer.propose(PROMPT, 3)
    assert proposer.offset == len(PROMPT) - 8 and tree.size == 3
    drafts = tree.tokens.tolist()
    assert proposer.cached_ids == PROMPT[-8:] + drafts[:2]  # the last draft is not fed
    # the window's drafts are the model's own greedy continuation of those 8 tokens alone
    with torch.inference_mode():
        ids = torch.tensor([PROMPT[-8:] + drafts[:2]])
        expected = tiny_target.model(ids).logits[0, -3:].argmax(dim=-1).tolist()
    assert drafts == expected
    # a short catch-up extends the window; a long one moves it
    context = PROMPT + drafts[:1] + [7]
    proposer.propose(context, 2)
    assert proposer.offset == len(PROMPT) - 8 and proposer.cached_ids[:10] == context[-10:]
    context = context + list(range(300, 320))
    proposer.propose(context, 2)
    assert proposer.offset == len(context) - 8 and proposer.cached_ids[:8] == context[-8:]


def test_a_draft_with_a_small_window_or_few_slots_gives_plain_output(tiny_target):
    """Every step drafting with a window of 4 tokens (each step's catch-up is up to 5: restarts)
    and with a cache of 48 slots (a 40-token prompt restarts the cache when it fills)."""
    prompts = [PROMPT, list(range(1000, 1030))]
    windowed = DraftModelProposer(tiny_target, catch_up_window=4)
    totals = assert_greedy_equals_plain(tiny_target, prompts, windowed, 4, 24)
    assert totals["draft_tokens"] > 0
    few_slots = DraftModelProposer(tiny_target, slots=48, catch_up_window=16)
    totals = assert_greedy_equals_plain(tiny_target, prompts, few_slots, 4, 24)
    assert totals["accepted_tokens"] > 0 and few_slots.offset > 0


def test_the_window_must_hold_a_token(tiny_target):
    with pytest.raises(ValueError, match="catch_up_window"):
        DraftModelProposer(tiny_target, catch_up_window=0)
