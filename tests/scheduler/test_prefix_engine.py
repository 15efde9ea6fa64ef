"""The engine with prefix caching: outputs equal decoding each request alone, for every kind of
reuse (a later turn adopting an earlier row, samples of one prompt sharing its prefill,
partial matches copied), every proposer (EAGLE-3 reads the cached prefix's taps), overlap on
and off, and with caching off; on the tiny model and on SmolLM2-135M (slow)."""

from __future__ import annotations

import random

import pytest

from scheduler_support import run_all
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.engine import Engine

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def first_turns() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(100, 5000) for _ in range(20)]  # a "system prompt"
    a = shared + [rng.randrange(100, 5000) for _ in range(9)]
    b = shared + [rng.randrange(100, 5000) for _ in range(25)]
    c = [rng.randrange(100, 5000) for _ in range(40)]
    return [a, a, a, b, c]  # three samples of a: one prefill


def next_turns(turns: list[list[int]], answers: list[list[int]]) -> list[list[int]]:
    """The conversation goes on: history + answer + a new question (the cached rows hold the
    history and all of the answer but its last token)."""
    return [prompt + answer + [7, 8, 9 + i] for i, (prompt, answer) in enumerate(zip(turns, answers))]


def engine(target, draft="none", overlap=False, **overrides) -> Engine:
    config = EngineConfig(**{"max_running": 4, "prefill_chunk": 16, "initial_kv_slots": 16,
                             "speculation": "always", "overlap": overlap, **overrides})
    return Engine(target, config, draft=draft).start()


def two_turns(served: Engine) -> tuple[list[list[int]], list[list[int]]]:
    turns = first_turns()
    first = [r[0] for r in run_all(served, [(p, PARAMS) for p in turns])]
    second_prompts = next_turns(turns, first)
    second = [r[0] for r in run_all(served, [(p, PARAMS) for p in second_prompts])]
    return first, second


@pytest.fixture(scope="module")
def alone(tiny_target):
    turns = first_turns()
    first = [generate(tiny_target, p, PARAMS).token_ids for p in turns]
    second = [generate(tiny_target, p, PARAMS).token_ids for p in next_turns(turns, first)]
    return first, second


@pytest.mark.parametrize("draft, overlap", [("none", False), ("none", True), ("ngram:3,1,3", False),
                                            ("self", True), ("eagle3", False), ("eagle3", True)])
def test_reused_prefixes_give_the_outputs_of_decoding_alone(tiny_target, alone, random_head_dir,
                                                            draft, overlap):
    spec = f"eagle3:{random_head_dir}" if draft == "eagle3" else draft
    served = engine(tiny_target, spec, overlap)
    try:
        first, second = two_turns(served)
    finally:
        served.shutdown()
    assert first == alone[0] and second == alone[1]
    stats = served.prefix_cache.stats()
    turns = first_turns()
    # first turns: the two later samples of a copy its 28 reusable tokens, b the 20 it shares
    # with a; second turns: each reuses at least its first turn's row (the prompt and the
    # answer but its last token, the root, whose keys were never computed)
    assert stats.hits >= 2 * 28 + 20 + sum(len(p) + len(a) - 1 for p, a in zip(turns, first))
    assert stats.queries == sum(map(len, turns)) + sum(map(len, next_turns(turns, first)))
    assert served.num_running == 0 and served.pool.num_free == served.pool.rows


def test_caching_off_reuses_nothing_and_gives_the_same_outputs(tiny_target, alone):
    served = engine(tiny_target, prefix_caching=False)
    try:
        first, second = two_turns(served)
    finally:
        served.shutdown()
    assert first == alone[0] and second == alone[1]
    assert served.prefix_cache is None and all(entry is None for entry in served.pool.cached)


def test_concurrent_requests_sharing_prefixes_under_eviction_equal_alone(tiny_target):
    """More distinct prefixes than rows: cached rows are evicted and moved while requests that
    share prefixes run together; every output still equals decoding alone."""
    rng = random.Random(5)
    stems = [[rng.randrange(100, 5000) for _ in range(rng.randrange(5, 30))] for _ in range(4)]
    prompts = [rng.choice(stems) + [rng.randrange(100, 5000) for _ in range(rng.randrange(1, 12))]
               for _ in range(14)]
    expected = [generate(tiny_target, p, PARAMS).token_ids for p in prompts]
    served = engine(tiny_target, "ngram:3,1,3", max_running=3)
    try:
        got = [r[0] for r in run_all(served, [(p, PARAMS) for p in prompts[:7]])]
        got += [r[0] for r in run_all(served, [(p, PARAMS) for p in prompts[7:]])]
    finally:
        served.shutdown()
    assert got == expected
    assert served.prefix_cache.stats().hits > 0 and served.prefix_cache.evictions > 0


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["none", "ngram", "eagle3:smollm2-135m"])
def test_smollm2_multiturn_with_caching_equals_caching_off(smollm_int4_target, smollm_tokenizer,
                                                          draft):
    """Real chat turns (MT-Bench questions, then a follow-up with the answer in the history):
    greedy outputs with caching on equal caching off, and the second turns reuse the first."""
    from eyas.bench.prompts import mtbench_first_turns
    from eyas.models.tokenizer import chat_prompt_ids

    params = SamplingParams(max_tokens=24)
    questions = mtbench_first_turns(3)
    runs = {}
    for caching in (True, False):
        served = engine(smollm_int4_target, draft, max_running=4, prefill_chunk=256,
                        prefix_caching=caching, speculation="auto")
        try:
            histories = [[{"role": "user", "content": q}] for q in questions]
            outputs = []
            for turn in range(2):
                prompts = [chat_prompt_ids(smollm_tokenizer, h) for h in histories]
                results = served.generate_many(prompts, params, 300)
                outputs.append([r.token_ids for r in results])
                for history, result in zip(histories, results):
                    history += [{"role": "assistant", "content": result.text},
                                {"role": "user", "content": "Say that again, more briefly."}]
            runs[caching] = (outputs, served.prefix_cache.stats() if caching else None)
        finally:
            served.shutdown()
    assert runs[True][0] == runs[False][0]
    stats = runs[True][1]
    assert stats.hits > 3 * 20  # every second turn reused its history
