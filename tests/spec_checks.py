"""The project's central invariant as one assertion: greedy speculative decoding emits exactly
the tokens of plain greedy decoding."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.policy import PolicyConfig

ALWAYS_SPECULATE = PolicyConfig(enabled=False)  # no fallback to plain steps: every step drafts


def assert_greedy_equals_plain(target, prompts: Sequence[list[int]], proposer, num_draft_tokens: int,
                               max_tokens: int, expected: Sequence[list[int]] | None = None) -> Counter:
    """Decode every prompt speculatively (fallback off) and assert the tokens equal plain greedy
    decoding (`expected`, or decoded here). Returns the summed counters draft_tokens,
    accepted_tokens and verification_steps, for the caller's checks that drafting happened."""
    params = SamplingParams(max_tokens=max_tokens)
    totals: Counter = Counter()
    for index, prompt in enumerate(prompts):
        plain = expected[index] if expected is not None else generate(target, prompt, params).token_ids
        result = speculative_generate(target, prompt, params, proposer, num_draft_tokens,
                                      policy=ALWAYS_SPECULATE)
        assert result.token_ids == plain, f"prompt {index}: the speculative output differs from plain"
        spec = result.stats["speculative"]
        totals.update({k: spec[k] for k in ("draft_tokens", "accepted_tokens", "verification_steps")})
    return totals
