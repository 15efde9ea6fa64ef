"""How many draft tokens each running request gets this step: per row, from each request's own
price, so that rows whose drafts do not pay draft nothing while the others draft.

Why per row. The step's pass is ragged (batch.py): each request brings its root and its own
draft tokens, no padding, and on a CPU a pass costs about what its queries cost (a fixed part
plus a part per query, speculation.StepCostModel.ragged_cost). So a request that drafts
nothing costs one query whatever the others draft, and a batch that mixes requests whose
drafts are accepted (a regenerated answer, a re-sent transcript) with requests whose drafts
are not (a new question) lets the first draft while the others stay plain:

    rows 0-5: 4 draft tokens each (accepted)    rows 6-15: none
    one pass of 16 + 24 queries                 instead of 16 x 5, padded

The plan. Row i drafting n_i tokens emits E_i(n_i) tokens on average, costs D_i(n_i) of
drafting and adds Q_i(n_i) draft queries to the pass (speculation.AcceptanceEstimate.quote; Q_i
= availability x n_i for a chain proposer that often finds nothing, as an n-gram lookup, which
then adds no query; E_i(0) = 1, D_i(0) = Q_i(0) = 0). With B decoding rows the pass costs about
c(B, 1) + q * sum_i Q_i(n_i), q the price of one draft query at B rows. A plan's rate is

    R = sum_i E_i(n_i) / (c(B, 1) + sum_i (q Q_i(n_i) + D_i(n_i))),

and for a given q the plan with the highest R is found exactly by Dinkelbach's method: for a
rate L, the plan maximising sum_i E_i - L (c(B, 1) + sum_i (q Q_i + D_i)) picks each row's n_i
on its own; if that maximum is positive its plan's rate beats L, and L moves up to it, until
no plan beats L. The first L is the plain step's rate times a margin, so speculation happens
only where it pays by that margin. Each round costs O(rows x max_draft_tokens).

The real pass is not linear in its queries: at one row a CPU's pass streams its weights
whatever its width, so a first draft query costs far less than the average one up to the
longest draft (SmolLM2 int4, Zen 4: 3.6 / 3.7 / 4.2 / 4.9 / 5.6 ms at 1-5 queries). So a lone
request's budgets are each priced by the ragged cost itself (k + 1 of them), and for several
rows q starts as the secant up to every row's longest draft and then moves to the secant up
to the plan it found (a few times, while it moves); of the plans found, the one with the
highest rate priced by the ragged cost itself is taken.

The step's token budget caps the pass's queries, sum_i (1 + n_i), not each row's share of it:
a row whose drafts pay may take more than budget / B while rows whose drafts do not pay take
none. When the per-row choices exceed that cap, the round's plan is the best one under it
(a multiple-choice knapsack over the rows, exact by dynamic programming over the draft tokens
left; O(rows x cap x max_draft_tokens) in numpy, only in the rounds where the cap binds).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from eyas.scheduler.speculation import AcceptanceEstimate, StepCostModel

MAX_ROUNDS = 8  # Dinkelbach rounds (it converges in 2-3)
MAX_SECANTS = 4  # prices of a draft query tried (see choose_draft_budgets)


def choose_draft_budgets(rows: Sequence[AcceptanceEstimate | None], costs: StepCostModel,
                         max_draft_tokens: int, margin: float = 1.05,
                         max_queries: int | None = None) -> list[int]:
    """Draft tokens per row (index = KV row; None = no decoding request there), each at most
    `max_draft_tokens`, and roots plus drafts at most `max_queries` in all (None: no cap): all
    0 (a plain step) unless a plan beats plain decoding by `margin`."""
    live = [i for i, row in enumerate(rows) if row is not None]
    budgets = [0] * len(rows)
    sequences = len(live)
    capacity = None if max_queries is None else max_queries - sequences  # draft tokens in all
    if capacity is not None:
        max_draft_tokens = min(max_draft_tokens, capacity)
    if not live or max_draft_tokens < 1:
        return budgets
    # per row and budget n: (expected tokens, drafting seconds, expected draft queries)
    prices = {i: [(1.0, 0.0, 0.0)] + [rows[i].quote(n) for n in range(1, max_draft_tokens + 1)] for i in live}
    if all(max(e for e, _, _ in prices[i]) <= 1.0 for i in live):
        return budgets  # nobody expects a draft token accepted
    plain = costs.ragged_cost(sequences, sequences)

    def secant(queries: float) -> float:  # the price of a draft query up to `queries` of them
        return max(costs.ragged_cost(sequences, sequences + queries) - plain, 0.0) / queries

    def rate(plan: list[int]) -> float:  # tokens per second, priced by the ragged cost itself
        chosen = [prices[i][plan[i]] for i in live]
        seconds = (costs.ragged_cost(sequences, sequences + sum(q for _, _, q in chosen))
                   + sum(d for _, d, _ in chosen))
        return sum(e for e, _, _ in chosen) / seconds if seconds > 0 else 0.0

    best, best_rate = budgets, margin * sequences / plain
    if sequences == 1:  # one request: every budget priced exactly
        (row,) = live
        for n in range(1, max_draft_tokens + 1):
            plan = [0] * len(rows)
            plan[row] = n
            plan_rate = rate(plan)
            if plan_rate > best_rate:
                best, best_rate = plan, plan_rate
        return best
    most = sequences * max_draft_tokens if capacity is None else min(sequences * max_draft_tokens, capacity)
    per_query, tried = secant(most), []
    while len(tried) < MAX_SECANTS and not any(abs(per_query - q) <= 0.02 * q for q in tried):
        tried.append(per_query)
        plan = linearised_plan(prices, live, len(rows), plain, per_query, best_rate, capacity)
        queries = sum(prices[i][plan[i]][2] for i in live) if plan is not None else 0.0
        if plan is None or queries <= 0:
            break
        plan_rate = rate(plan)
        if plan_rate > best_rate:
            best, best_rate = plan, plan_rate
        per_query = secant(queries)  # the price of a query at this plan's own size
    return best


def linearised_plan(prices: dict[int, list[tuple[float, float, float]]], live: list[int],
                    width: int, plain: float, per_query: float, floor: float,
                    capacity: int | None) -> list[int] | None:
    """Dinkelbach's method (the module docstring) with the pass priced at `plain` plus
    `per_query` a draft query: the plan with the highest such rate, if it beats `floor`."""
    rate, found = floor, None
    for _ in range(MAX_ROUNDS):
        values = {i: [e - rate * (per_query * q + d) for e, d, q in prices[i]] for i in live}
        value, choice = best_choices(values, capacity)
        value -= rate * plain
        if value <= 1e-12:
            break
        plan = [0] * width
        for i, n in choice.items():
            plan[i] = n
        found = plan
        tokens = sum(prices[i][plan[i]][0] for i in live)
        seconds = plain + sum(per_query * prices[i][plan[i]][2] + prices[i][plan[i]][1] for i in live)
        if seconds <= 0:
            break
        rate = tokens / seconds
    return found


def best_choices(values: dict[int, list[float]], capacity: int | None) -> tuple[float, dict[int, int]]:
    """(the largest sum_i values[i][n_i], the n_i) with sum_i n_i <= capacity (None: no cap).
    Each row on its own (the first best n) where that fits; else a dynamic program over the
    draft tokens used so far, rows in order, each row's step one numpy max over its choices
    (64 rows x a cap of 448 x 9 choices: ~1 ms, where a Python loop took ~56 ms); values within
    1e-12 of the best count as equal, and the fewer draft tokens wins them."""
    own = {i: max(range(len(v)), key=v.__getitem__) for i, v in values.items()}
    if capacity is None or sum(own.values()) <= capacity:
        return sum(values[i][n] for i, n in own.items()), own
    # best[c]: the best value of the rows so far using exactly c draft tokens (-inf: cannot)
    best = np.full(capacity + 1, -np.inf)
    best[0] = 0.0
    picks: list[tuple[int, np.ndarray]] = []  # per row: (row, the n that reached each c)
    for i, row_values in values.items():
        choices = min(len(row_values), capacity + 1)
        padded = np.concatenate([np.full(choices - 1, -np.inf), best])  # [choices - 1 + cap + 1]
        # [c, n] = best[c - n] + values[n]: row i takes n of the c draft tokens used so far
        totals = sliding_window_view(padded, choices)[:, ::-1] + np.asarray(row_values[:choices])
        top = totals.max(axis=1)  # [c]
        taken = np.argmax(totals >= top[:, None] - 1e-12, axis=1)  # the fewest n near the top
        best = top
        picks.append((i, taken))
    top = best.max()
    used = int(np.argmax(best >= top - 1e-12))  # the fewest draft tokens within 1e-12
    value, choice = float(best[used]), {}
    for i, taken in reversed(picks):
        choice[i] = int(taken[used])
        used -= choice[i]
    return value, choice
