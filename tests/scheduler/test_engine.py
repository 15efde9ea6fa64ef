"""The engine end to end on a tiny model: every request's output equals decoding it alone.

Batches mix prompt lengths, chunked prefill, more requests than rows (queueing and row moves),
KV growth, drafts from every proposer, and overlap on and off.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest

from scheduler_support import run_all
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.draft import DraftTree
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.engine import Engine


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    varied = [[rng.randrange(100, 5000) for _ in range(rng.randrange(2, 50))] for _ in range(8)]
    return varied + [[5, 6, 7, 8, 9] * 8, [11, 12, 13] * 10]  # repetitive: n-grams match


@pytest.fixture(scope="module")
def plain(tiny_target):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    return [generate(tiny_target, p, params) for p in prompts()]


def engine(target, draft="none", overlap=False, **overrides) -> Engine:
    config = EngineConfig(**{"max_running": 4, "prefill_chunk": 16, "initial_kv_slots": 16,
                             "speculation": "always", "overlap": overlap, **overrides})
    return Engine(target, config, draft=draft).start()


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("draft", ["none", "ngram:3,1,3", "self"])
def test_batched_greedy_equals_plain(tiny_target, plain, draft, overlap):
    served = engine(tiny_target, draft, overlap)
    try:
        results = served.generate_many(prompts(), SamplingParams(max_tokens=24, ignore_eos=True), 60)
    finally:
        served.shutdown()
    for result, expected in zip(results, plain):
        assert result.token_ids == expected.token_ids
        assert result.text == expected.text
        assert result.finish_reason == "length"
    if draft == "self":  # the target drafting for itself: every draft accepted
        spec = [r.stats["speculative"] for r in results]
        assert all(s["accepted_tokens"] == s["draft_tokens"] > 0 for s in spec)
    if draft.startswith("ngram"):
        assert sum(r.stats["speculative"]["accepted_tokens"] for r in results) > 0


def test_per_request_parameters_in_one_batch(tiny_target, plain):
    """max_tokens, stop strings and seeded sampling differ per request, in the same steps."""
    base = prompts()
    stop_text = plain[1].text[len(plain[1].text) // 2 :][:3]
    jobs = [
        (base[0], SamplingParams(max_tokens=5, ignore_eos=True)),
        (base[1], SamplingParams(max_tokens=24, stop=[stop_text], ignore_eos=True)),
        (base[2], SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)),
        (base[8], SamplingParams(max_tokens=24, ignore_eos=True)),
        # plain temperature: Gumbel draws through the screen, one noise per output position,
        # so its tokens equal decoding alone with or without drafts (engine/gumbel.py)
        (base[3], SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)),
    ]
    served = engine(tiny_target, "ngram")
    try:
        results = run_all(served, jobs)
    finally:
        served.shutdown()
    for (prompt, params), (tokens, text, final) in zip(jobs, results):
        alone = generate(tiny_target, prompt, params)  # sampling: same seed, same draws
        drawn = params.temperature > 0 and params.top_p == 1.0
        if params.greedy or drawn or final.speculative["draft_tokens"] == 0:
            assert tokens == alone.token_ids and text == alone.text
        assert final.finish_reason == alone.finish_reason
    assert results[1][2].finish_reason == "stop" and stop_text not in results[1][1]


def test_a_cancelled_request_ends_with_abort_and_frees_its_row(tiny_target):
    served = engine(tiny_target, max_running=2)
    first = threading.Event()
    finals = []

    def on_output(output):
        first.set()
        if output.finished:
            finals.append(output)

    request = served.submit(list(range(100, 120)), SamplingParams(max_tokens=200, ignore_eos=True),
                            on_output)
    try:
        assert first.wait(30)
        served.abort(request.request_id)
        other = served.generate([7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True), 30)
    finally:
        served.shutdown()
    assert finals and finals[0].finish_reason == "abort" and finals[0].completion_tokens < 200
    assert other.finish_reason == "length" and served.num_running == 0


class BrokenProposer:
    name, tap_layers = "broken", ()

    def begin(self, target, prompt_ids, params):
        pass

    def propose(self, token_ids, max_nodes) -> DraftTree:
        raise RuntimeError("proposer bug")

    def observe(self, tree, result, output):
        pass


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(tiny_target):
    served = engine(tiny_target, "ngram")
    good_prototype = served.proposers.prototype
    try:
        served.proposers.prototype = BrokenProposer()
        failed = served.generate([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True), 30)
        served.proposers.prototype = good_prototype
        fine = served.generate([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True), 30)
    finally:
        served.shutdown()
    assert failed.finish_reason == "error"
    assert fine.finish_reason == "length" and len(fine.token_ids) == 6


class CatchUpProposer:
    """Drafts nothing useful but, like EAGLE-3 or a draft model, pays for every token since it
    was last asked: 0.2 s for the prompt, 1 ms for what one step emitted."""

    name, tap_layers = "catch-up", ()

    def begin(self, target, prompt_ids, params):
        self.seen = 0

    def propose(self, token_ids, max_nodes) -> DraftTree:
        time.sleep(0.2 if len(token_ids) - self.seen > 8 else 0.001)
        self.seen = len(token_ids)
        return DraftTree.chain([1] * max_nodes)

    def observe(self, tree, result, output):
        pass


def test_the_prompt_catch_up_is_not_counted_as_drafting_cost(tiny_target):
    """A proposer's first call catches up over the whole prompt: were it timed as drafting,
    the speculation rule would price every draft token at 50 ms and never speculate."""
    served = engine(tiny_target, "ngram")
    served.proposers.prototype = CatchUpProposer()
    try:
        finished = threading.Event()
        request = served.submit(list(range(100, 140)), SamplingParams(max_tokens=6, ignore_eos=True),
                                lambda output: output.finished and finished.set())
        assert finished.wait(30)
    finally:
        served.shutdown()
    per_token = request.acceptance.draft_seconds_per_token
    assert 0 < per_token < 0.02  # the 1 ms calls only (4 draft tokens each)
    assert 0 < served.executor.pooled.draft_seconds_per_token < 0.02


def test_speculation_auto_measures_costs_and_stays_equal(tiny_target, plain):
    served = engine(tiny_target, "ngram", speculation="auto", max_running=2)
    try:
        results = served.generate_many(prompts()[-2:], SamplingParams(max_tokens=24, ignore_eos=True), 60)
    finally:
        served.shutdown()
    assert served.costs is not None and served.costs.cost(2, 3) > 0
    assert served.executor.pooled.asked > 0  # acceptance observed (shadow drafts or real ones)
    assert [r.token_ids for r in results] == [p.token_ids for p in plain[-2:]]


@pytest.mark.parametrize("draft", ["none", "self"])
def test_eos_inside_an_accepted_draft_ends_the_answer_where_plain_does(tiny_target, plain, draft):
    """A token of the plain answer is made an EOS token: both paths must stop right before it,
    also when it sits in the middle of a fully accepted draft (self-drafting)."""
    answer = plain[8].token_ids
    eos = answer[9]
    target = dataclasses.replace(tiny_target, config=dataclasses.replace(tiny_target.config,
                                                                         eos_token_ids=[eos]))
    params = SamplingParams(max_tokens=24)
    alone = generate(target, prompts()[8], params)
    served = engine(target, draft)
    try:
        one_token = served.generate_many([prompts()[8], prompts()[0]], SamplingParams(max_tokens=1), 30)
        result = served.generate(prompts()[8], params, 30)
    finally:
        served.shutdown()
    assert alone.finish_reason == "stop" and alone.token_ids == answer[: answer.index(eos)]
    assert result.token_ids == alone.token_ids and result.finish_reason == "stop"
    assert result.stats.get("speculative", {"draft_tokens": 1})["draft_tokens"] > 0
    assert [(len(r.token_ids), r.finish_reason) for r in one_token] == [(1, "length")] * 2


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_eagle3_drafts_across_the_batch_equal_plain(tiny_target, plain, random_head_dir, overlap):
    """EAGLE-3 reads the target's taps from the batched pass (and from chunked prefill)."""
    served = engine(tiny_target, f"eagle3:{random_head_dir}", overlap)
    try:
        results = served.generate_many(prompts(), SamplingParams(max_tokens=24, ignore_eos=True), 60)
    finally:
        served.shutdown()
    assert [r.token_ids for r in results] == [p.token_ids for p in plain]
    assert sum(r.stats["speculative"]["draft_tokens"] for r in results) > 0


def test_eagle3_with_an_ngram_graft_across_the_batch_equals_plain(tiny_target, plain,
                                                                  random_head_dir, monkeypatch):
    """`eagle3:DIR+ngram`: each request's tree carries its own prompt-lookup branch."""
    from eyas.engine.speculative.proposers import graft

    grafted = []
    original = graft.graft_branch

    def counting(tree, branch, max_nodes):
        merged, node_map = original(tree, branch, max_nodes)
        grafted.append(merged.size - tree.size)
        return merged, node_map

    monkeypatch.setattr(graft, "graft_branch", counting)
    # a fixed two-node head tree leaves room in the step's 4 draft tokens for the branch
    served = engine(tiny_target, f"eagle3:{random_head_dir}+ngram:3,1,3", tree="2,1,3")
    try:
        results = served.generate_many(prompts(), SamplingParams(max_tokens=24, ignore_eos=True), 60)
    finally:
        served.shutdown()
    assert [r.token_ids for r in results] == [p.token_ids for p in plain]
    assert sum(grafted) > 0  # the repetitive prompts got n-gram branches


def test_an_eagle3_engine_starts_from_the_heads_measured_draft_cost(tiny_target, random_head_dir):
    """Before any request drafts, the server-wide estimate prices a draft token at the head's
    measured cost, not at zero (which made a fresh server speculate where it did not pay)."""
    config = EngineConfig(max_running=2, initial_kv_slots=16, speculation="auto")
    served = Engine(tiny_target, config, draft=f"eagle3:{random_head_dir}")
    head_pass = served.proposers.prototype.cost.draft(1)
    assert head_pass > 0
    assert served.scheduler.pooled.draft_seconds_per_token == head_pass
    plain = Engine(tiny_target, config, draft="ngram")
    assert plain.scheduler.pooled.draft_seconds_per_token == 0.0


def test_an_auto_eagle3_engine_prices_each_requests_tree_and_calibrates_its_drafting(
        tiny_target, plain, random_head_dir):
    """In auto mode the serving rule reads each request's own tree price (expected tokens per
    budget, speculation.TreePricing) and scales the head's modelled drafting time by what the
    engine measured; outputs stay equal to plain. The target's pass is priced as a
    memory-bound one (a GPU's: 1 + k tokens cost what one does) so that whether drafting pays
    does not hinge on this machine's timing of a 2-layer model beside a head of the same size."""
    config = EngineConfig(max_running=2, prefill_chunk=16, initial_kv_slots=16, speculation="auto")
    served = Engine(tiny_target, config, draft=f"eagle3:{random_head_dir}")
    served.costs.table = {cell: 1.0 for cell in served.costs.table}
    served.costs.smoothing = 0.0  # measured steps do not pull the prices back to this CPU's
    served.start()
    try:
        finished = threading.Event()
        request = served.submit(prompts()[-1], SamplingParams(max_tokens=24, ignore_eos=True),
                                lambda output: output.finished and finished.set())
        proposer = request.proposer
        assert finished.wait(60)
    finally:
        served.shutdown()
    assert proposer.expected_tokens(2) is not None  # the head's costs were measured
    assert request.proposer is None and request.acceptance.tree is None  # let go once finished
    assert request.token_ids[-24:] == plain[-1].token_ids
    assert request.spec_metrics.drafted > 0  # the untrained head's optimistic prior drafts
    assert served.executor.pooled.draft_calibration != 1.0  # measured drafting was compared


def test_the_shipped_head_fused_beside_the_int4_target_serves_a_batch_equal_to_plain(
        smollm_int4_target, mtbench_prompt_ids):
    """int4 SmolLM2 and its shipped head on the fused C++ layer (eagle3/fused.py): each request
    of the batch keeps its own head KV cache, and every output equals plain decoding."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = mtbench_prompt_ids[:3]
    expected = [generate(smollm_int4_target, p, params).token_ids for p in prompts]
    served = engine(smollm_int4_target, "eagle3:smollm2-135m", tree="2,2,3", max_running=3)
    try:
        assert served.proposers.prototype.fused is not None or \
            smollm_int4_target.model.fused_layers() is None
        results = served.generate_many(prompts, params, 120)
    finally:
        served.shutdown()
    assert [r.token_ids for r in results] == expected
    spec = [r.stats["speculative"] for r in results]
    assert sum(s["draft_tokens"] for s in spec) > 0 and sum(s["accepted_tokens"] for s in spec) > 0


def test_a_finished_request_lets_go_of_its_draft_models_cache(tiny_target):
    """Whoever still holds a finished request (a client's handle) does not keep the draft
    model's KV cache alive: the engine drops the request's proposer once its final output is
    out (and its speculative statistics are in it)."""
    import threading

    served = engine(tiny_target, "self")
    done = threading.Event()
    finals = []

    def on_output(output):
        if output.finished:
            finals.append(output)
            done.set()

    try:
        request = served.submit(prompts()[0], SamplingParams(max_tokens=16, ignore_eos=True), on_output)
        assert done.wait(60)
        for _ in range(100):  # the engine forgets the request right after its final output
            if request.proposer is None:
                break
            threading.Event().wait(0.05)
    finally:
        served.shutdown()
    assert request.proposer is None
    assert finals[0].speculative is not None and finals[0].speculative["draft_tokens"] > 0


class StateRecorder:
    """An observer that keeps every queue and KV report the engine sends."""

    def __init__(self) -> None:
        self.steps = 0
        self.queues: list[tuple[int, int]] = []
        self.rows_in_use: list[int] = []

    def step_finished(self, stats) -> None:
        self.steps += 1

    def request_finished(self, request) -> None:
        pass

    def queue_changed(self, running: int, waiting: int) -> None:
        self.queues.append((running, waiting))

    def kv_changed(self, rows_in_use: int, rows: int, slots: int, cache_bytes: int) -> None:
        self.rows_in_use.append(rows_in_use)


def test_the_queue_and_kv_gauges_are_reported_when_they_change_not_every_step(tiny_target):
    recorder = StateRecorder()
    engine = Engine(tiny_target, EngineConfig(max_running=2, initial_kv_slots=64), draft="none",
                    observer=recorder).start()
    try:
        prompt = tiny_target.tokenizer.encode("The quick brown fox")
        engine.generate_many([prompt, prompt], SamplingParams(max_tokens=24), timeout=120)
        deadline = time.monotonic() + 10
        while engine.num_running and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
    finally:
        engine.shutdown()
    assert recorder.steps >= 24  # one decode step a token at least
    assert len(recorder.rows_in_use) == len(recorder.queues) + 1  # + the empty pool, at start
    assert len(recorder.queues) < recorder.steps / 2
    assert (2, 0) in recorder.queues  # both running
    assert recorder.queues[-1] == (0, 0) and recorder.rows_in_use[-1] == 0  # idle, reported
