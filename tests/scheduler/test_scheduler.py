"""Scheduler budgets: admission by free KV rows, the per-step token budget, chunked prefill,
draft tokens capped by the budget, row packing on release; engine-side queue and context checks."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.sampling import SamplingParams
from eyas.errors import EyasError
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.engine import Engine, QueueFull, RequestRejected
from eyas.scheduler.kv_pool import KVPool
from eyas.scheduler.scheduler import IDLE_PLANS, IDLE_PRICE_EVERY, PLAIN_PROBE_EVERY, Scheduler
from eyas.scheduler.speculation import StepCostModel


def chunks(plan):
    return [(c.request, c.start, c.end) for c in plan.prefill]


def new_scheduler(target, speculative=False, **overrides):
    config = EngineConfig(**{"max_running": 2, "max_step_tokens": 64, "prefill_chunk": 16,
                             "speculation": "always", **overrides})
    return Scheduler(config, KVPool(target, config.max_running, 128, 32), speculative)


def test_admission_needs_a_free_row_and_prefill_is_chunked(tiny_target, make_request):
    scheduler = new_scheduler(tiny_target)
    a, b, c = make_request(40), make_request(40), make_request(10)
    for request in (a, b, c):
        scheduler.add(request)
    plan = scheduler.schedule()
    assert chunks(plan) == [(a, 0, 16), (b, 0, 16)]  # two rows: c waits
    assert (a.row, b.row, c.row) == (0, 1, None) and list(scheduler.waiting) == [c]
    assert chunks(scheduler.schedule()) == [(a, 16, 32), (b, 16, 32)]
    plan = scheduler.schedule()
    assert chunks(plan) == [(a, 32, 40), (b, 32, 40)] and plan.decode == []
    plan = scheduler.schedule()  # prompts fully scheduled: both decode
    assert plan.decode == [a, b] and plan.prefill == []


def test_the_token_budget_limits_chunks(tiny_target, make_request):
    scheduler = new_scheduler(tiny_target, max_step_tokens=20)
    a, b = make_request(40), make_request(40)
    scheduler.add(a)
    scheduler.add(b)
    assert chunks(scheduler.schedule()) == [(a, 0, 16), (b, 0, 4)]


def test_draft_tokens_are_capped_by_the_budget(tiny_target, make_request):
    scheduler = new_scheduler(tiny_target, speculative=True, max_step_tokens=8, num_draft_tokens=4,
                              prefill_chunk=8, max_running=2)
    a, b = make_request(8), make_request(8)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()  # a prefills (8 tokens fill the budget)
    scheduler.schedule()  # b prefills while a decodes
    plan = scheduler.schedule()
    assert plan.decode == [a, b]
    assert plan.num_draft_tokens == 3  # 2 rows x (1 + 3) = 8 tokens
    never = new_scheduler(tiny_target, speculative=True, speculation="never")
    never.add(make_request(4))
    never.schedule()
    assert never.schedule().num_draft_tokens == 0


def test_speculation_keeps_plain_probes(tiny_target, make_request):
    flat = StepCostModel([1], {(1, t): 0.01 for t in range(1, 6)}, 5)  # drafts cost nothing
    config = EngineConfig(max_running=1, max_step_tokens=64, num_draft_tokens=4, speculation="auto")
    scheduler = Scheduler(config, KVPool(tiny_target, 1, 128, 32), True, flat)
    scheduler.add(make_request(4))
    scheduler.schedule()  # admission and prefill
    chosen = [scheduler.schedule().num_draft_tokens for _ in range(2 * PLAIN_PROBE_EVERY)]
    probes = [i for i, k in enumerate(chosen) if k == 0]
    assert probes == [PLAIN_PROBE_EVERY - 1, 2 * PLAIN_PROBE_EVERY - 1]
    assert all(k == 4 for i, k in enumerate(chosen) if i not in probes)


def one_request_never_accepted(target, make_request, extra: float):
    """A speculative scheduler (auto) decoding one request whose drafts are never accepted
    (acceptance priors 0), after its prefill; a pass of T > 1 tokens costs `extra` more than
    one of a single token."""
    costs = StepCostModel([1], {(1, t): 0.01 * (1 + extra * (t > 1)) for t in range(1, 6)}, 5)
    config = EngineConfig(max_running=1, max_step_tokens=64, num_draft_tokens=4, speculation="auto")
    scheduler = Scheduler(config, KVPool(target, 1, 128, 32), True, costs)
    request = make_request(4, max_tokens=400)
    scheduler.add(request)
    scheduler.schedule()  # admission and prefill
    request.acceptance.prior_alpha = request.acceptance.prior_availability = 0.0
    return scheduler, request


@pytest.mark.parametrize("extra, probes", [(0.0, [31, 95, 223]), (0.5, [49, 113, 241])])
def test_plain_decoding_keeps_backing_off_draft_probes(tiny_target, make_request, extra, probes):
    """Acceptance 0: never worth speculating, yet a draft probe (one draft token per request)
    comes after 32 plain steps, then 64, then 128 (and at least 50 apart where a 2-token pass
    costs 50% more than a 1-token pass: 1% of the time at most)."""
    scheduler, request = one_request_never_accepted(tiny_target, make_request, extra)
    chosen = [scheduler.schedule().num_draft_tokens for _ in range(300)]
    assert [i for i, k in enumerate(chosen) if k] == probes
    assert {chosen[i] for i in probes} == {1}
    request.acceptance.prior_alpha = request.acceptance.prior_availability = 1.0
    # drafting pays now, seen at the next priced step (every IDLE_PRICE_EVERY-th while idle)
    waited = [scheduler.schedule().num_draft_tokens for _ in range(IDLE_PRICE_EVERY)]
    assert waited[-1] == 4 and set(waited[:-1]) <= {0}
    request.acceptance.prior_alpha = request.acceptance.prior_availability = 0.0
    chosen = [scheduler.schedule().num_draft_tokens for _ in range(probes[0] + 1)]  # the back-off reset
    assert [i for i, k in enumerate(chosen) if k] == [probes[0]]


def test_rows_are_priced_less_often_while_no_draft_pays(tiny_target, make_request, monkeypatch):
    """After IDLE_PLANS priced steps in a row that chose no draft, the rows are priced every
    IDLE_PRICE_EVERY-th step only (pricing suffix-decoding rows costs ~80 us each); a plan
    that drafts prices every step again."""
    import eyas.scheduler.scheduler as scheduler_module

    priced = []
    choose = scheduler_module.choose_draft_budgets

    def counting(*args, **kwargs):
        priced.append(len(priced))
        return choose(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "choose_draft_budgets", counting)
    scheduler, request = one_request_never_accepted(tiny_target, make_request, 0.5)
    calls = []
    for _ in range(IDLE_PLANS + 4 * IDLE_PRICE_EVERY):
        before = len(priced)
        scheduler.schedule()
        calls.append(len(priced) - before)
    assert calls[:IDLE_PLANS] == [1] * IDLE_PLANS
    assert calls[IDLE_PLANS:] == ([0] * (IDLE_PRICE_EVERY - 1) + [1]) * 4
    request.acceptance.prior_alpha = request.acceptance.prior_availability = 1.0
    drafted = [scheduler.schedule().num_draft_tokens for _ in range(IDLE_PRICE_EVERY + 3)]
    assert drafted[-3:] == [4, 4, 4] and len(priced) == IDLE_PLANS + 4 + 4


def test_release_packs_rows_and_moves_their_kv(tiny_target, make_request):
    scheduler = new_scheduler(tiny_target)
    a, b = make_request(4), make_request(4)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    b.context_length = 4
    scheduler.pool.cache.keys[:, 1, :, :4] = 5.0
    a.token_done = True
    assert scheduler.release_done() == [a]
    assert b.row == 0 and scheduler.running == [b] and a.row is None
    assert torch.all(scheduler.pool.cache.keys[:, 0, :, :4] == 5.0)


def test_queue_full_and_context_checks(tiny_target):
    engine = Engine(tiny_target, EngineConfig(max_running=1, max_waiting=2))  # not started
    params = SamplingParams(max_tokens=4)
    engine.submit([5, 6, 7], params)
    engine.submit([5, 6, 7], params)
    with pytest.raises(QueueFull):
        engine.submit([5, 6, 7], params)
    limit = engine.max_model_len
    with pytest.raises(RequestRejected) as error:
        engine.submit(list(range(3, limit + 3)), params)
    assert error.value.field == "prompt"
    with pytest.raises(RequestRejected) as error:
        engine.submit([5, 6], SamplingParams(max_tokens=limit))
    assert error.value.field == "max_tokens"


def linear_costs(batch_sizes=(1, 4)) -> StepCostModel:
    """A pass of N queries costs 4 ms + 1.5 ms per query after the first (any B)."""
    table = {(b, t): 0.004 + 0.0015 * (b * t - 1) for b in batch_sizes for t in (1, 2)}
    return StepCostModel(list(batch_sizes), table, 2)


def decoding_four_and_one_joining(target, make_request, stretch):
    config = EngineConfig(max_running=5, max_step_tokens=256, prefill_chunk=64,
                          speculation="never", prefill_stretch=stretch)
    scheduler = Scheduler(config, KVPool(target, 5, 512, 32), False, linear_costs())
    for _ in range(4):
        scheduler.add(make_request(4))
    scheduler.schedule()  # four short prompts, nothing decoding yet
    joining = make_request(200)
    scheduler.add(joining)
    return scheduler, joining


@pytest.mark.parametrize("stretch, first_chunk", [
    (None, 64),  # the token budget alone: a full chunk
    (10.0, 49),  # 4 decode rows cost 8.5 ms: prefill may add 76.5 ms = 4 + 1.5 (P - 1), P = 49
    (1.5, 32),  # 4.25 ms would allow 1 token: the floor keeps the prompt moving
])
def test_prefill_is_priced_against_the_decode_pass(tiny_target, make_request, stretch, first_chunk):
    scheduler, joining = decoding_four_and_one_joining(tiny_target, make_request, stretch)
    plan = scheduler.schedule()
    assert len(plan.decode) == 4 and chunks(plan) == [(joining, 0, first_chunk)]
    steps = 1
    while not joining.prefill_complete_scheduled:  # a long prompt still finishes
        plan = scheduler.schedule()
        assert len(plan.decode) == 4 and len(plan.prefill) == 1
        assert plan.prefill[0].end - plan.prefill[0].start == min(first_chunk, 200 - plan.prefill[0].start)
        steps += 1
    assert steps == -(-200 // first_chunk)


def test_prefill_takes_full_chunks_when_nothing_decodes(tiny_target, make_request):
    config = EngineConfig(max_running=2, max_step_tokens=256, prefill_chunk=64,
                          speculation="never", prefill_stretch=1.5)
    scheduler = Scheduler(config, KVPool(tiny_target, 2, 512, 32), False, linear_costs())
    a, b = make_request(100), make_request(100)
    scheduler.add(a)
    scheduler.add(b)
    assert chunks(scheduler.schedule()) == [(a, 0, 64), (b, 0, 64)]


@pytest.mark.parametrize("stretch", [1.0, 0.5, float("nan")])
def test_a_prefill_stretch_must_exceed_one(stretch):
    with pytest.raises(EyasError, match="prefill_stretch must be > 1"):
        EngineConfig(prefill_stretch=stretch)
