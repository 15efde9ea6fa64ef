"""Logits processors keep speculation lossless: with a processor that depends on the completion
so far, greedy speculative output (single-stream and batched) equals plain greedy output under
the same processor, on SmolLM2-135M in int4.

The processor discourages every token already in the completion, so a draft node's row must be
processed with the path to that node: a processor fed the wrong history picks other tokens."""

from __future__ import annotations

import pytest

from spec_checks import ALWAYS_SPECULATE
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
from eyas.engine.speculative.proposers.ngram import NgramConfig, NgramProposer

NEW_TOKENS = 32


def discourage_repeats(output_ids, logits):
    """Lower every token the completion already holds (a fixed function of the history)."""
    if output_ids:
        logits[sorted(set(output_ids))] -= 2.5
    return logits


@pytest.fixture(scope="module")
def target(smollm_int4_target):
    return smollm_int4_target


@pytest.fixture(scope="module")
def prompts(mtbench_prompt_ids):
    return mtbench_prompt_ids[:3]


@pytest.fixture(scope="module")
def plain_processed(target, prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS)
    return [generate(target, p, params, logits_processors=[discourage_repeats]).token_ids
            for p in prompts]


def test_the_processor_changes_plain_output(target, prompts, plain_processed):
    params = SamplingParams(max_tokens=NEW_TOKENS)
    unprocessed = [generate(target, p, params).token_ids for p in prompts]
    assert unprocessed != plain_processed
    for tokens in plain_processed:  # a repeat costs 2.5: far fewer repeated tokens
        assert len(set(tokens)) > 0.6 * len(tokens)


@pytest.mark.parametrize("method", ["ngram-tree", "self"])
def test_speculative_greedy_with_a_processor_equals_plain(target, prompts, plain_processed,
                                                          method):
    if method == "self":  # the target drafts for itself: every node's row must match plain's
        proposer = DraftModelProposer(target, name="self")
    else:
        proposer = NgramProposer(NgramConfig(max_n=3, min_n=1, max_matches=3))
    params = SamplingParams(max_tokens=NEW_TOKENS)
    drafted = accepted = 0
    for prompt, expected in zip(prompts, plain_processed):
        result = speculative_generate(target, prompt, params, proposer, 4,
                                      policy=ALWAYS_SPECULATE, logits_processors=[discourage_repeats])
        assert result.token_ids == expected
        drafted += result.stats["speculative"]["draft_tokens"]
        accepted += result.stats["speculative"]["accepted_tokens"]
    assert drafted > 0
    if method == "self":
        # the unprocessed self-draft proposes the raw argmax; accepted only where the processed
        # argmax agrees, so some are accepted and some rejected
        assert 0 < accepted < drafted


def test_batched_engine_with_a_processor_equals_plain(target, prompts, plain_processed):
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine

    config = EngineConfig(max_running=4, prefill_chunk=32, initial_kv_slots=64, speculation="always")
    engine = Engine(target, config, draft="ngram:3,1,3").start()
    try:
        results = engine.generate_many(prompts, SamplingParams(max_tokens=NEW_TOKENS), 300,
                                       logits_processors=[discourage_repeats])
    finally:
        engine.shutdown()
    assert [r.token_ids for r in results] == plain_processed
    assert sum(r.stats["speculative"]["draft_tokens"] for r in results) > 0
