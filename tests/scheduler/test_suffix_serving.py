"""`--draft suffix` through the serving engine: concurrent requests share one global store, and
every output equals decoding the request alone (plain greedy), on the tiny model and on
SmolLM2-135M; the store's size and hits reach /metrics."""

from __future__ import annotations

import pytest

from eyas.bench.prompts import CODE_PROMPTS
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.models.tokenizer import chat_prompt_ids
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.engine import Engine
from eyas.server.metrics import ServerMetrics


def serve(target, draft: str, prompts: list[list[int]], params: SamplingParams, rounds: int = 2,
          **overrides) -> tuple[list[list[list[int]]], Engine]:
    """Every prompt served `rounds` times by one engine (all prompts of a round at once)."""
    config = EngineConfig(**{"max_running": 4, "prefill_chunk": 32, "initial_kv_slots": 32,
                             "speculation": "always", **overrides})
    engine = Engine(target, config, draft=draft).start()
    try:
        outputs = [[r.token_ids for r in engine.generate_many(prompts, params, 300)]
                   for _ in range(rounds)]
    finally:
        engine.shutdown()
    return outputs, engine


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_suffix_serving_on_the_tiny_model_equals_plain(tiny_target, overlap):
    prompts = [[5, 6, 7, 8, 9] * 8, [11, 12, 13] * 10, list(range(300, 340)), [40, 41] * 12]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [generate(tiny_target, p, params).token_ids for p in prompts]
    (first, second), engine = serve(tiny_target, "suffix:2", prompts, params, overlap=overlap)
    assert first == plain and second == plain
    store = engine.proposers.suffix_store()
    assert store.stats()["documents"] == len(prompts) and store.hits > 0
    metrics = ServerMetrics("tiny")
    metrics.watch_suffix_store(store.stats)
    text = metrics.exposition().decode()
    assert f'eyas:suffix_store_documents{{engine="0",model_name="tiny"}} {float(len(prompts))}' in text
    assert "eyas:suffix_store_hits_total" in text and "eyas:suffix_store_max_bytes" in text


def test_suffix_serving_on_smollm_equals_plain_and_drafts_the_repeats(smollm_int4_target, smollm_tokenizer,
                                                                      mtbench_prompt_ids):
    """Two MT-Bench and two code prompts served at once, then again (SmolLM2 in int4): the
    second round drafts the first round's answers from the shared store; every output is the
    plain one."""
    target = smollm_int4_target
    code = [chat_prompt_ids(smollm_tokenizer, [{"role": "user", "content": q}]) for q in CODE_PROMPTS[:2]]
    prompts = mtbench_prompt_ids[:2] + code
    params = SamplingParams(max_tokens=32)
    plain = [generate(target, p, params).token_ids for p in prompts]
    config = EngineConfig(max_running=4, prefill_chunk=64, initial_kv_slots=64, speculation="always")
    engine = Engine(target, config, draft="suffix:4").start()
    try:
        first = engine.generate_many(prompts, params, 300)
        second = engine.generate_many(prompts, params, 300)
    finally:
        engine.shutdown()
    assert [r.token_ids for r in first] == plain and [r.token_ids for r in second] == plain
    accepted = [sum(r.stats["speculative"]["accepted_tokens"] for r in run) for run in (first, second)]
    assert accepted[1] > max(accepted[0], len(prompts) * 16)  # most of each answer was drafted


def test_eagle3_with_suffix_serving_on_smollm_equals_plain(smollm_int4_target, mtbench_prompt_ids):
    target = smollm_int4_target
    prompts = mtbench_prompt_ids[:4]
    params = SamplingParams(max_tokens=32)
    plain = [generate(target, p, params).token_ids for p in prompts]
    (first, second), engine = serve(target, "eagle3:smollm2-135m+suffix:4", prompts, params,
                                    prefill_chunk=64, tree="auto")
    assert first == plain and second == plain
    assert engine.proposers.suffix_store().hits > 0


class PassCounter:
    """An EngineObserver that keeps the decode passes' shapes: the most passes a step ran, and
    the steps whose one pass mixed rows with drafts and rows without (or drafts of several
    lengths), checking that no pass held a padding row."""

    def __init__(self) -> None:
        self.most_passes = 0
        self.mixed_steps = 0
        self.padded_steps = 0

    def step_finished(self, stats) -> None:
        self.most_passes = max(self.most_passes, stats.passes)
        if stats.decode_rows:
            self.padded_steps += stats.queries != stats.decode_rows + stats.draft_tokens
            self.mixed_steps += (stats.drafts > 0 and stats.queries < stats.decode_rows * stats.tokens_per_row)

    def request_finished(self, request) -> None:
        pass

    def queue_changed(self, running: int, waiting: int) -> None:
        pass

    def kv_changed(self, rows_in_use: int, rows: int, slots: int, cache_bytes: int) -> None:
        pass


def serve_counting(target, prompts: list[list[int]], params: SamplingParams, draft: str,
                   **overrides) -> tuple[list[list[list[int]]], PassCounter]:
    """Every prompt served twice (all at once each time), the passes' shapes counted."""
    counter = PassCounter()
    config = EngineConfig(**{"max_running": 4, "prefill_chunk": 64, "initial_kv_slots": 64,
                             "speculation": "always", **overrides})
    engine = Engine(target, config, draft=draft, observer=counter).start()
    try:
        outputs = [[r.token_ids for r in engine.generate_many(prompts, params, 300)] for _ in range(2)]
    finally:
        engine.shutdown()
    return outputs, counter


def test_one_ragged_pass_over_rows_of_mixed_draft_lengths_equals_plain(tiny_target):
    """Rows whose suffix trees are drafted and rows with nothing to draft share each step's one
    pass, each with its own number of queries (no padding); every output is the plain one."""
    prompts = [[5, 6, 7, 8, 9] * 8, list(range(300, 340)), [11, 12, 13] * 10, list(range(400, 440))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [generate(tiny_target, p, params).token_ids for p in prompts]
    outputs, counter = serve_counting(tiny_target, prompts, params, "suffix:2", num_draft_tokens=3)
    assert outputs == [plain, plain]
    assert counter.most_passes == 1 and counter.padded_steps == 0 and counter.mixed_steps > 0


def test_ragged_passes_of_the_int4_target_with_suffix_drafts_equal_plain(smollm_int4_target, smollm_tokenizer,
                                                                          mtbench_prompt_ids):
    """The int4 target's ragged passes (the C++ stack with each row's own sequence): two
    MT-Bench and two code prompts, served twice at once, drafts of mixed lengths; every output
    is the plain one."""
    code = [chat_prompt_ids(smollm_tokenizer, [{"role": "user", "content": q}]) for q in CODE_PROMPTS[:2]]
    prompts = mtbench_prompt_ids[:2] + code
    params = SamplingParams(max_tokens=32)
    plain = [generate(smollm_int4_target, p, params).token_ids for p in prompts]
    outputs, counter = serve_counting(smollm_int4_target, prompts, params, "suffix:4")
    assert outputs == [plain, plain]
    assert counter.most_passes == 1 and counter.padded_steps == 0 and counter.mixed_steps > 0
