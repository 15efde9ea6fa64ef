"""The project's central invariant as one assertion: greedy speculative decoding emits exactly
the tokens of plain greedy decoding."""

from __future__ import annotations

import random
from collections import Counter
from typing import Sequence

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.policy import PolicyConfig

ALWAYS_SPECULATE = PolicyConfig(enabled=False)  # no fallback to plain steps: every step drafts


COUNTERS = ("draft_tokens", "accepted_tokens", "verification_steps")


def assert_greedy_equals_plain(target, prompts: Sequence[list[int]], proposer, num_draft_tokens: int,
                               max_tokens: int, expected: Sequence[list[int]] | None = None,
                               counters: Sequence[str] = COUNTERS) -> Counter:
    """Decode every prompt speculatively (fallback off) and assert the tokens equal plain greedy
    decoding (`expected`, or decoded here). Returns the summed `counters` of the speculative
    statistics (draft_tokens, accepted_tokens, verification_steps), for the caller's checks
    that drafting happened."""
    params = SamplingParams(max_tokens=max_tokens)
    totals: Counter = Counter()
    for index, prompt in enumerate(prompts):
        plain = expected[index] if expected is not None else generate(target, prompt, params).token_ids
        result = speculative_generate(target, prompt, params, proposer, num_draft_tokens,
                                      policy=ALWAYS_SPECULATE)
        assert result.token_ids == plain, f"prompt {index}: the speculative output differs from plain"
        spec = result.stats["speculative"]
        totals.update({k: spec[k] for k in counters})
    return totals


def assert_batched_serving_equals_plain(target, draft: str, seed: int,
                                        prompts: Sequence[list[int]] | None = None) -> int:
    """`prompts` (default: five random ones) served at once by the engine (`--draft draft`,
    speculation always, small chunks and KV slots) equal plain greedy decoding of each; returns
    the draft tokens verified in all."""
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine

    if prompts is None:
        rng = random.Random(seed)
        prompts = [[rng.randrange(100, 5000) for _ in range(rng.randrange(2, 40))] for _ in range(5)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = [generate(target, p, params).token_ids for p in prompts]
    config = EngineConfig(max_running=4, prefill_chunk=16, initial_kv_slots=16, speculation="always")
    engine = Engine(target, config, draft=draft).start()
    try:
        results = engine.generate_many(prompts, params, 60)
    finally:
        engine.shutdown()
    assert [r.token_ids for r in results] == plain
    return sum(r.stats["speculative"]["draft_tokens"] for r in results)
