"""The draft-length rule: speculate only where measured costs and acceptance say it pays."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.scheduler.draft_plan import best_choices, choose_draft_budgets
from eyas.scheduler.speculation import (SHADOW_MAX_GAP, AcceptanceEstimate, ShadowDraft, StepCostModel,
                                        branch_lesson, monotone, shadow_gap)


def cpu_like_costs(max_tokens: int = 5) -> StepCostModel:
    """A pass costs a fixed part plus a part per token in it (compute-bound, as on a CPU):
    c(B, T) = 10 ms + 2 ms * B * T."""
    sizes = [1, 2, 4, 8, 16]
    table = {(b, t): 0.010 + 0.002 * b * t for b in sizes for t in range(1, max_tokens + 1)}
    return StepCostModel(sizes, table, max_tokens)


def choose_draft_length(estimates, rows, costs, most):
    """The largest budget the per-row rule gives any of `estimates` (rows 0.. of a span of
    `rows`)."""
    by_row = list(estimates) + [None] * (rows - len(estimates))
    return max(choose_draft_budgets(by_row, costs, most))


def estimate(alpha: float, trials: float = 100.0) -> AcceptanceEstimate:
    """A request whose drafts were always found and accepted at per-token rate alpha."""
    return AcceptanceEstimate(accepted=alpha * trials, trials=trials, found=trials, asked=trials)


def test_expected_tokens_follows_the_geometric_formula():
    e = estimate(0.6, trials=1e6)
    assert e.expected_tokens(0) == 1.0
    assert e.expected_tokens(3) == pytest.approx(1 + 0.6 + 0.36 + 0.216, rel=1e-3)
    e.record(2, 1)  # one more verification: 1 of 2 accepted, then a rejection
    assert e.alpha < 0.6 + 1e-3
    half_found = AcceptanceEstimate(accepted=60, trials=100, found=50, asked=100)
    assert half_found.expected_tokens(1) == pytest.approx(1 + (51 / 102) * (61 / 102), rel=1e-6)


def test_high_acceptance_speculates_at_small_batch_and_stops_at_large_batch():
    costs = cpu_like_costs()
    good = [estimate(0.6) for _ in range(16)]
    assert choose_draft_length(good[:1], 1, costs, 4) > 0
    k_small = choose_draft_length(good[:2], 2, costs, 4)
    k_large = choose_draft_length(good, 16, costs, 4)
    assert k_small >= k_large
    assert k_large == 0  # at 16 rows every extra token costs as much as it brings


def test_low_acceptance_never_speculates():
    costs = cpu_like_costs()
    poor = [estimate(0.1) for _ in range(2)]
    assert choose_draft_length(poor, 2, costs, 4) == 0


def test_plain_step_estimates_drift_back_to_the_prior():
    e = estimate(0.0, trials=20)
    low = e.alpha
    for _ in range(300):
        e.relax()
    assert e.alpha > low and e.alpha == pytest.approx(e.prior_alpha, abs=0.05)


def test_cost_model_interpolates_and_follows_measurements():
    costs = cpu_like_costs()
    assert costs.cost(3, 2) == pytest.approx((costs.cost(2, 2) + costs.cost(4, 2)) / 2)
    assert costs.cost(32, 1) == pytest.approx(costs.cost(16, 1) * 2)  # beyond the grid
    before = costs.cost(4, 3)
    for _ in range(50):  # ragged passes of 4 requests, 12 queries: what c(4, 3) prices
        costs.observe_ragged(4, 12, 2 * before)
    assert costs.cost(4, 3) == pytest.approx(2 * before, rel=0.05)


def test_measured_costs_cover_every_shape(tiny_target):
    costs = StepCostModel.measure(tiny_target, [1, 2], 3, context=8, rounds=1)
    assert set(costs.table) == {(b, t) for b in (1, 2) for t in (1, 2, 3)}
    assert all(seconds > 0 for seconds in costs.table.values())


def test_measured_costs_time_the_executors_passes(tiny_target, monkeypatch):
    """One request: the lone request's calls (decode_rows / decode_one then greedy_tokens) where
    the fused stack runs, else the dense pass; several: one ragged pass over every row."""
    from eyas.scheduler import pass_costs

    calls = []
    model = tiny_target.model
    forward = type(model).forward

    def counting_forward(self, input_ids, *args, **kwargs):
        if input_ids is not None:
            calls.append(("forward", tuple(input_ids.shape)))
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting_forward)
    table = pass_costs.measure_pass_costs(tiny_target, [1, 3], 2, context=8, rounds=1)
    assert set(table) == {(1, 1), (1, 2), (3, 1), (3, 2)}
    passes = [shape for name, shape in calls if name == "forward"]
    assert (1, 8) in passes and (3, 8) in passes  # each cache's context, prefilled as text
    assert (1, 6) in passes and (1, 3) in passes  # ragged: 3 roots (+ 3 drafts), no padding
    assert (1, 2) in passes  # one request, a float32 model: the dense pass of one row


def test_a_first_draft_is_priced_at_the_pass_it_makes():
    """At one row a CPU pass streams its weights whatever its width: 4.0 ms for one query, 4.1
    for two, then 2 ms a query. A draft accepted 30% of the time pays as one token (1.3 tokens
    / 4.1 ms beats 1 / 4.0 by 1.27x), not at the average price of four (1.42 tokens / 10.1 ms)."""
    table = {(1, t): 0.0040 + 0.0001 * (t > 1) + 0.002 * max(t - 2, 0) for t in range(1, 6)}
    costs = StepCostModel([1], table, 5)
    assert choose_draft_budgets([estimate(0.3)], costs, 4) == [1]
    assert choose_draft_budgets([estimate(0.02)], costs, 4) == [0]  # 1.02 / 4.1 ms loses


def test_a_proposer_that_rarely_finds_a_draft_pays_only_for_the_drafts_it_finds():
    """An n-gram lookup that matches one step in ten, accepted at 0.9 when it does: a budget
    of 4 adds 0.4 queries on average (1.31 tokens / 12.8 ms with c(1, T) = 10 + 2 T ms, 1.25x
    plain), not 4 (1.31 / 20 ms, slower than plain)."""
    rare = AcceptanceEstimate(accepted=0.9 * 1000, trials=1000, found=100, asked=1000)
    assert rare.quote(4)[2] == pytest.approx(0.4, abs=0.01)  # draft queries a budget of 4 adds
    assert choose_draft_length([rare], 1, cpu_like_costs(), 4) == 4


def test_profile_noise_is_capped_by_larger_shapes():
    noisy = {(1, 1): 5.0, (1, 2): 2.0, (2, 1): 3.0, (2, 2): 4.0}  # (1, 1) hit by noise
    assert monotone(noisy, [1, 2], 2) == {(1, 1): 2.0, (1, 2): 2.0, (2, 1): 3.0, (2, 2): 4.0}


def test_a_shadow_draft_measures_what_verification_would_have_accepted():
    shadow = ShadowDraft()
    # a tree: 5 -> 6 -> 7 and 9 beside 5; the first branch is 5, 6, 7
    shadow.start(DraftTree(torch.tensor([5, 6, 9, 7]), torch.tensor([0, 1, 0, 2])))
    assert shadow.tokens == [5, 6, 7]
    assert shadow.follow([5]) is None and shadow.follow([6]) is None  # one plain step each
    assert shadow.follow([8]) == (3, 2) and not shadow.active  # the target said 8, not 7
    shadow.start(DraftTree.chain([1, 2]))
    assert shadow.follow([1, 2, 3]) == (2, 2)  # all accepted
    shadow.start(DraftTree.chain([4]))
    assert shadow.follow([3]) == (1, 0)


def test_a_shadow_draft_teaches_its_proposer_what_verifying_its_first_branch_would_have():
    """Nodes 1 (5) -> 2 (6) -> 4 (7), and 3 (9) beside node 1: the target emits 5, 6, 8. Trials
    are the branch's nodes whose parent was emitted (1, 2, 4), hits 1 and 2; node 3 was never
    verified, so it is no trial (None)."""
    shadow = ShadowDraft()
    shadow.start(DraftTree(torch.tensor([5, 6, 9, 7]), torch.tensor([0, 1, 0, 2])), ["a", "b", "c", "d"])
    assert (shadow.branch, shadow.nodes) == ([1, 2, 4], ["a", "b", "c", "d"])
    branch, nodes = shadow.branch, shadow.nodes
    assert shadow.follow([5, 6, 8]) == (3, 2) and shadow.nodes is None
    assert branch_lesson(nodes, branch, 2) == (["a", "b", None, "d"], [1, 2])
    shadow.start(DraftTree.chain([1, 2]), ["x"])  # a record that does not fit the tree: none
    assert shadow.nodes is None


def test_a_dearer_proposer_drafts_in_the_shadow_less_often():
    assert shadow_gap(0.5e-6, 1e-6) == 1  # within the share: every plain step
    assert shadow_gap(3.5e-6, 1e-6) == 4  # 3.5 shares: one step in 4
    assert shadow_gap(SHADOW_MAX_GAP * 1e-6, 1e-6) == SHADOW_MAX_GAP
    assert shadow_gap((SHADOW_MAX_GAP + 0.5) * 1e-6, 1e-6) is None  # not asked at all
    assert shadow_gap(1e-6, 0.0) is None
    # the executor's rule: 16 rows of 1 ms each, a share of 20 us a row; a proposer at 15 us a
    # draft token, 4 tokens a draft (60 us: 3 shares) shadows on one plain step in 3
    from types import SimpleNamespace

    from eyas.scheduler.executor import StepExecutor
    from eyas.scheduler.scheduler import StepPlan

    executor = SimpleNamespace(costs=StepCostModel([16], {(16, 1): 0.016}, 1))
    request = SimpleNamespace(proposer=object(), shadow=ShadowDraft(),
                              acceptance=AcceptanceEstimate(draft_seconds_per_token=15e-6))
    plan = StepPlan(max_draft_tokens=4)
    allowed = [StepExecutor._shadow_allowed(executor, request, plan, 16) for _ in range(9)]
    assert allowed == [True, False, False] * 3  # (nothing starts the shadow here: none in flight)
    request.acceptance.draft_seconds_per_token = 50e-6  # 200 us: 10 shares, never
    assert not any(StepExecutor._shadow_allowed(executor, request, plan, 16) for _ in range(20))


class PricedTree:
    """A tree proposer's own price list: expected tokens and modelled drafting time by budget."""

    def __init__(self, tokens: dict[int, float] | None, seconds_per_level: float = 0.001) -> None:
        self.tokens, self.seconds_per_level = tokens, seconds_per_level

    def expected_tokens(self, max_nodes: int) -> float | None:
        return None if self.tokens is None else self.tokens[min(max_nodes, max(self.tokens))]

    def draft_seconds(self, max_nodes: int) -> float:
        return self.seconds_per_level * max_nodes


def test_a_tree_proposer_is_priced_by_its_own_tree_not_by_a_chain():
    # c(1, T) = 12, 14, 16, 18, 20 ms for T = 1..5; plain = 83.3 tok/s, to beat by 5%: 87.5.
    costs = cpu_like_costs()
    chain = estimate(0.2)  # per-depth acceptance 0.2: 1.2 / 14 ms = 85.7 tok/s, no k pays
    assert choose_draft_length([chain], 1, costs, 4) == 0
    # The same request drafting a tree that accepts 0.45 / 0.75 / 0.85 / 0.9 tokens for
    # budgets 1..4 at 1 ms per budget node: 96.7, 97.2, 92.5, 86.4 tok/s -> k = 2.
    tree = estimate(0.2)
    tree.tree = PricedTree({1: 1.45, 2: 1.75, 3: 1.85, 4: 1.9})
    assert tree.expected_tokens(2) == pytest.approx(1.75)  # calibration 1 a priori
    assert choose_draft_length([tree], 1, costs, 4) == 2
    # Drafting measured at 3x its model: 85.3, 79.5, ... tok/s -> plain.
    for _ in range(40):
        tree.record_draft_calibration(measured=0.003, modelled=0.001)
    assert tree.draft_calibration == pytest.approx(3.0, rel=1e-3)
    assert choose_draft_length([tree], 1, costs, 4) == 0
    # A proposer that cannot price its tree (a fixed shape) falls back to the chain model.
    unpriced = estimate(0.2)
    unpriced.tree = PricedTree(None)
    assert unpriced.expected_tokens(3) == pytest.approx(chain.expected_tokens(3))
    assert unpriced.quote(3)[1] == 3 * unpriced.draft_seconds_per_token
    # Seeded copies keep the calibration (a new request starts from what the server measured).
    assert tree.seeded().draft_calibration == tree.draft_calibration and tree.seeded().tree is None


def test_tree_prices_are_calibrated_by_what_verification_realised():
    tree = estimate(0.2)
    tree.tree = PricedTree({1: 1.9, 2: 2.8, 3: 3.6, 4: 4.3})  # over-confident candidates
    for _ in range(60):  # every tree priced at 2.8 - 1 = 1.8 accepted tokens realised 1
        tree.record_tree(1.8, 1)
    # recent trees weigh most (forgetting 0.9), beside a prior of 1: (10 + 2) / (18 + 2)
    assert tree.calibration == pytest.approx(0.6, abs=0.01)
    assert tree.expected_tokens(2) == pytest.approx(1 + tree.calibration * 1.8)
    # calibrated above 1, a k-node tree is still never priced above k accepted tokens
    sure = estimate(0.2)
    sure.tree = PricedTree({1: 1.95, 2: 2.9})
    for _ in range(60):
        sure.record_tree(0.9, 1)
    assert sure.calibration > 1.05 and sure.expected_tokens(1) == pytest.approx(2.0)
    assert sure.seeded().prior_calibration == pytest.approx(sure.calibration)


def test_rows_whose_drafts_do_not_pay_draft_nothing_while_others_draft():
    """16 rows: 6 whose suffix trees are all but sure (a regenerated answer), 10 that have
    nothing to draft; c(B, T) = 20 ms + 1 ms * B * T, so 1 ms per draft query of a ragged pass.
    Plain: 16 tokens / 36 ms = 444 tok/s (467 to beat with the margin). The 6 rows drafting 4
    tokens each, the 10 others none: 38.8 tokens / (36 + 24) ms = 647 tok/s."""
    sizes = [1, 2, 4, 8, 16]
    costs = StepCostModel(sizes, {(b, t): 0.020 + 0.001 * b * t for b in sizes for t in range(1, 6)}, 5)
    sure = [estimate(0.2) for _ in range(6)]
    for row in sure:
        row.tree = PricedTree({1: 1.96, 2: 2.92, 3: 3.88, 4: 4.8}, seconds_per_level=0.0)
    none = [estimate(0.0) for _ in range(10)]
    for row in none:
        row.tree = PricedTree({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0})
    assert choose_draft_budgets([*sure, *none], costs, 4) == [4] * 6 + [0] * 10
    # interleaved: the same (a ragged pass does not care where the rows sit), 34.8 tokens /
    # (32 + 24) ms
    mixed = [sure[i // 2] if i % 2 == 0 else none[i // 2] for i in range(12)]
    assert choose_draft_budgets(mixed, costs, 4) == [4, 0] * 6
    # the whole batch useless: plain
    assert choose_draft_budgets(none + [None], costs, 4) == [0] * 11


def test_a_ragged_pass_is_priced_by_its_queries():
    """A ragged pass of B requests and N queries costs what the padded pass of as many queries
    does, c(B, N / B): with c(B, T) = 10 ms + 2 ms * B * T, c(B, 1) + 2 ms per draft query,
    whatever the requests' share of the draft queries."""
    costs = cpu_like_costs()
    assert costs.ragged_cost(8, 8) == pytest.approx(costs.cost(8, 1))
    assert costs.ragged_cost(8, 12) == pytest.approx(0.010 + 0.002 * 12)
    assert costs.ragged_cost(16, 40) == pytest.approx(0.010 + 0.002 * 40)
    assert costs.ragged_cost(3, 5) == pytest.approx(costs.cost(3, 1) + 2 * 0.002)  # interpolated B
    assert costs.ragged_cost(2, 14) == pytest.approx(0.010 + 0.002 * 14)  # past the longest T (5)
    costs.observe_ragged(8, 12, 2 * costs.ragged_cost(8, 12))  # the machine got slower
    assert costs.cost(8, 1) == pytest.approx(1.25 * (0.010 + 0.002 * 8))  # smoothing 0.25
    assert costs.cost(8, 5) == pytest.approx(1.25 * (0.010 + 0.002 * 40))  # every T moves with it


def four_rows_at_one_ms_a_query():
    """c(B, T) = 20 ms + 1 ms * B * T: 4 rows cost 24 ms plain, 1 ms more per draft query."""
    sizes = [1, 2, 4]
    return StepCostModel(sizes, {(b, t): 0.020 + 0.001 * b * t for b in sizes for t in range(1, 6)}, 5)


def tree_rows(*trees: dict[int, float]) -> list[AcceptanceEstimate]:
    rows = []
    for tree in trees:
        row = estimate(0.0)
        row.tree = PricedTree(tree, seconds_per_level=0.0)
        rows.append(row)
    return rows


NOTHING = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}  # no candidate: nothing to draft


def test_the_budget_caps_a_ragged_pass_queries_not_each_rows_share():
    """One row whose suffix tree is all but sure (0.96 tokens a node), three with nothing to
    draft, a budget of 8 queries (4 roots + 4 draft tokens): the sure row takes all 4 draft
    tokens, 7.8 tokens / 28 ms, where an even share (8 / 4 - 1 = 1 a row) would give it one,
    4.96 tokens / 25 ms."""
    rows = tree_rows({1: 1.96, 2: 2.92, 3: 3.88, 4: 4.8}, NOTHING, NOTHING, NOTHING)
    assert choose_draft_budgets(rows, four_rows_at_one_ms_a_query(), 4, max_queries=8) == [4, 0, 0, 0]
    assert choose_draft_budgets(rows, four_rows_at_one_ms_a_query(), 4, max_queries=6) == [2, 0, 0, 0]
    assert choose_draft_budgets(rows, four_rows_at_one_ms_a_query(), 4, max_queries=4) == [0, 0, 0, 0]


def test_under_the_cap_the_best_plan_splits_the_draft_tokens():
    """Two rows with diminishing trees (0.9, 0.8, 0.7, 0.6 tokens for nodes 1-4), two with
    nothing; uncapped both take 4 (10 tokens / 32 ms); capped at 8 queries, 4 draft tokens:
    2 + 2 (7.4 tokens / 28 ms) beats 3 + 1 (7.3), 4 + 0 (7.0) and 1 + 1 (5.8 / 26 ms)."""
    shrinking = {1: 1.9, 2: 2.7, 3: 3.4, 4: 4.0}
    rows = tree_rows(shrinking, NOTHING, shrinking, NOTHING)
    costs = four_rows_at_one_ms_a_query()
    assert choose_draft_budgets(rows, costs, 4) == [4, 0, 4, 0]
    assert choose_draft_budgets(rows, costs, 4, max_queries=8) == [2, 0, 2, 0]
    assert choose_draft_budgets(rows, costs, 3, max_queries=8) == [2, 0, 2, 0]
    assert choose_draft_budgets(rows, costs, 4, max_queries=20) == [4, 0, 4, 0]  # the cap is loose


@pytest.mark.parametrize("seed", range(6))
def test_the_capped_plan_is_the_best_of_every_plan_under_the_cap(seed):
    """best_choices against every combination: 4 rows, 0-3 draft tokens each, random values,
    caps 0-12; the value is the best sum under the cap and the plan reaches it within it."""
    import itertools
    import random

    rng = random.Random(seed)
    values = {row: [0.0] + [rng.uniform(-1.0, 2.0) for _ in range(3)] for row in (0, 2, 3, 5)}
    for cap in range(13):
        brute = max(sum(values[row][n] for row, n in zip(values, plan))
                    for plan in itertools.product(range(4), repeat=4) if sum(plan) <= cap)
        value, plan = best_choices(values, cap)
        assert value == pytest.approx(brute, abs=1e-9)
        assert sum(plan.values()) <= cap
        assert sum(values[row][n] for row, n in plan.items()) == pytest.approx(brute, abs=1e-9)
