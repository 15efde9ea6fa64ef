"""Under a JSON schema (grammar mask on every tree node, forbidden drafts pruned), greedy
speculative output equals plain greedy output under the same schema, single-stream and
batched, with n-gram drafts and the shipped EAGLE-3 head; on SmolLM2-135M in int4."""

from __future__ import annotations

import json

import pytest

from spec_checks import ALWAYS_SPECULATE
from eyas.bench.structured import SCHEMAS, chat_prompts, follows
from eyas.engine.generate import generate
from eyas.engine.grammar import GrammarSpec, compile_grammar
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.methods import build_proposer

NEW_TOKENS = 64
CASES = [0, 3, 7]  # person, sentiment enum, prime (integer + boolean)


@pytest.fixture(scope="module")
def target(smollm_int4_target):
    return smollm_int4_target


@pytest.fixture(scope="module")
def grammars(target):
    return [compile_grammar(GrammarSpec("json_schema", SCHEMAS[i][1]), target.tokenizer,
                            target.config.vocab_size, sorted(target.eos_token_ids))
            for i in CASES]


@pytest.fixture(scope="module")
def prompts(target):
    every = chat_prompts(target)
    return [every[i] for i in CASES]


@pytest.fixture(scope="module")
def plain_constrained(target, prompts, grammars):
    params = SamplingParams(max_tokens=NEW_TOKENS)
    return [generate(target, p, params, logits_processors=[g.constraint()])
            for p, g in zip(prompts, grammars)]


def test_plain_output_under_the_schema_is_valid_json(plain_constrained):
    for result, case in zip(plain_constrained, CASES):
        assert result.finish_reason == "stop"
        assert follows(json.loads(result.text), SCHEMAS[case][1]), result.text


@pytest.mark.parametrize("draft", ["ngram:3,1,3", "eagle3:smollm2-135m"])
def test_single_stream_speculative_under_a_schema_equals_plain(target, prompts, grammars,
                                                               plain_constrained, draft):
    params = SamplingParams(max_tokens=NEW_TOKENS)
    drafted = 0
    for prompt, grammar, expected in zip(prompts, grammars, plain_constrained):
        proposer = build_proposer(draft, target, "chain:3" if draft.startswith("eagle3") else None)
        result = speculative_generate(target, prompt, params, proposer, 4, policy=ALWAYS_SPECULATE,
                                      logits_processors=[grammar.constraint()])
        assert result.token_ids == expected.token_ids
        drafted += result.stats["speculative"]["draft_tokens"]
    assert drafted > 0


@pytest.mark.parametrize("draft", ["ngram:3,1,3", "eagle3:smollm2-135m"])
def test_batched_engine_under_a_schema_equals_plain(target, prompts, grammars, plain_constrained,
                                                    draft):
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine

    config = EngineConfig(max_running=4, prefill_chunk=32, initial_kv_slots=64, speculation="always")
    engine = Engine(target, config, draft=draft).start()
    try:  # one constraint per prompt: a constraint holds its request's grammar state
        results = engine.generate_many(prompts, SamplingParams(max_tokens=NEW_TOKENS), 900,
                                       logits_processors=[[g.constraint()] for g in grammars])
    finally:
        engine.shutdown()
    assert [r.token_ids for r in results] == [r.token_ids for r in plain_constrained]
    assert sum(r.stats["speculative"]["draft_tokens"] for r in results) > 0
