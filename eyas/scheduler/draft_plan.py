"""How many draft tokens each running request gets this step, and how the rows are split
into target passes: per row, from each request's own price, so that rows whose drafts do not
pay draft nothing while the others draft.

Why per row. A pass pads its rows to one length T, and on a CPU a pass costs about what its
B x T tokens cost (c(B, T) of speculation.py grows almost in proportion to T at 16 rows).
Under one k for the whole batch, a row that drafts nothing still pays for T = 1 + k; a batch
that mixes requests whose drafts are accepted (a regenerated answer, a re-sent transcript)
with requests whose drafts are not (a new question) then either speculates and wastes the
padding, or does not and wastes the good drafts. So the rows may be split into several
passes, each over a run of neighbouring KV rows with its own length:

    rows 0-5: T = 5 (their drafts are accepted)    rows 6-15: T = 1 (plain)
    cost c(6, 5) + c(10, 1)  instead of  c(16, 5) or c(16, 1)

The plan. Row i drafting n_i tokens emits E_i(n_i) tokens on average and costs D_i(n_i) of
drafting (speculation.AcceptanceEstimate.price; E_i(0) = 1, D_i(0) = 0). A plan is a set of
segments [a, b) of rows, each run as one pass of length T_s, and the n_i <= T_s - 1 of its rows;
the rows of no decoding request (prompts still prefilling) need no segment. Its rate is

    R = sum_i E_i(n_i) / (sum_s c(b_s - a_s, T_s) + sum_i D_i(n_i)),

and the plan with the highest R is found exactly by Dinkelbach's method: for a rate L, the plan
maximising sum_i E_i - L (sum_s c + sum_i D) is a dynamic programme over the rows (the value
of a segment is additive over its rows); if that maximum is positive its plan's rate beats L,
and L moves up to it, until no plan beats L. The first L is the plain step's rate times a
margin, so speculation happens only where it pays by that margin. Segments cost
O(rows^2 x max_draft_tokens) per round, microseconds beside a pass.

The executor splits the step's rows into passes again once the trees are drafted
(`split_rows`): with the trees' real sizes, a proposer that found less than its budget
shortens its pass.
"""

from __future__ import annotations

from typing import Sequence

from eyas.scheduler.speculation import AcceptanceEstimate, StepCostModel

MAX_ROUNDS = 8  # Dinkelbach rounds (it converges in 2-3)


def choose_draft_budgets(rows: Sequence[AcceptanceEstimate | None], costs: StepCostModel,
                         max_draft_tokens: int, margin: float = 1.05) -> list[int]:
    """Draft tokens per row (index = KV row in the pass span; None = no decoding request
    there): all 0 (a plain step) unless a plan beats plain decoding by `margin`."""
    span = len(rows)
    live = [i for i, row in enumerate(rows) if row is not None]
    budgets = [0] * span
    if not live or max_draft_tokens < 1:
        return budgets
    prices: dict[int, list[tuple[float, float]]] = {}
    for i in live:
        estimate = rows[i]
        prices[i] = [(1.0, 0.0)] + [estimate.price(n) for n in range(1, max_draft_tokens + 1)]
    if all(max(e for e, _ in prices[i]) <= 1.0 for i in live):
        return budgets  # nobody expects a draft token accepted
    cost = _cost_table(costs, span, max_draft_tokens + 1)
    rate = margin * len(live) / costs.cost(span, 1)
    best: list[int] | None = None
    for _ in range(MAX_ROUNDS):
        value, plan = _best_plan(prices, span, cost, max_draft_tokens, rate)
        if value <= 1e-12 or plan is None:
            break
        best = plan
        tokens = sum(prices[i][plan[i]][0] for i in live)
        seconds = _plan_seconds(plan, rows, cost) + sum(prices[i][plan[i]][1] for i in live)
        if seconds <= 0:
            break
        rate = tokens / seconds
    return best if best is not None else budgets


def _plan_seconds(plan: list[int], rows: Sequence[AcceptanceEstimate | None],
                  cost: list[list[float]]) -> float:
    """Modelled pass seconds of a plan's budgets, split the cheapest way."""
    sizes = [0 if row is None else 1 + n for row, n in zip(rows, plan)]
    return sum(cost[stop - start][max(sizes[start:stop])] for start, stop in _split(sizes, cost))


def _best_plan(prices: dict[int, list[tuple[float, float]]], span: int, cost: list[list[float]],
               most: int, rate: float) -> tuple[float, list[int] | None]:
    """max over plans of sum_i E_i - rate * (sum_s c + sum_i D_i), and its budgets."""
    lengths = range(1, most + 2)  # T of a pass
    # 1. Each row's best draft length within a pass of length T, and its value there.
    gain = {t: [0.0] * (span + 1) for t in lengths}  # prefix sums over rows
    choice = {t: [0] * span for t in lengths}
    for t in lengths:
        running = 0.0
        for i in range(span):
            if i in prices:
                values = [e - rate * d for e, d in prices[i][:t]]
                n = max(range(t), key=values.__getitem__)
                choice[t][i] = n
                running += values[n]
            gain[t][i + 1] = running
    # 2. Segments: value[j] = best over rows [0, j); a row of no request may be left out.
    value = [0.0] + [float("-inf")] * span
    back: list[tuple[int, int]] = [(0, 0)] * (span + 1)  # (segment start, T); T 0 = row left out
    for j in range(1, span + 1):
        if j - 1 not in prices:
            value[j], back[j] = value[j - 1], (j - 1, 0)
        for a in range(j):
            if value[a] == float("-inf"):
                continue
            for t in lengths:
                v = value[a] + gain[t][j] - gain[t][a] - rate * cost[j - a][t]
                if v > value[j]:
                    value[j], back[j] = v, (a, t)
    budgets = [0] * span
    j = span
    while j > 0:
        a, t = back[j]
        for i in range(a, j):
            if t and i in prices:
                budgets[i] = choice[t][i]
        j = a
    return value[span], budgets


def split_rows(sizes: Sequence[int], costs: StepCostModel | None) -> list[tuple[int, int]]:
    """Row ranges [start, stop), one target pass each, that cover every row of size > 0 (its
    queries: root + draft nodes; 0 = no decoding request) at the least modelled cost. Without
    a cost model, or when no row drafted, one pass over every row."""
    span = len(sizes)
    if costs is None or span <= 1 or max(sizes, default=0) <= 1:
        return [(0, span)]
    return _split(list(sizes), _cost_table(costs, span, max(sizes)))


def _cost_table(costs: StepCostModel, span: int, longest: int) -> list[list[float]]:
    """cost[b][t]: modelled seconds of a pass over b rows of t tokens (b <= span, t <= longest;
    0 where b or t is 0)."""
    return [[0.0] * (longest + 1)] + [[0.0] + [costs.cost(b, t) for t in range(1, longest + 1)]
                                      for b in range(1, span + 1)]


def _split(sizes: list[int], cost: list[list[float]]) -> list[tuple[int, int]]:
    span = len(sizes)
    best = [0.0] + [float("inf")] * span
    back = [(0, False)] * (span + 1)  # (segment start, whether [start, j) is a pass)
    for j in range(1, span + 1):
        if sizes[j - 1] == 0:
            best[j], back[j] = best[j - 1], (j - 1, False)
        longest = 0
        for a in range(j - 1, -1, -1):  # segment [a, j), grown leftwards
            longest = max(longest, sizes[a])
            if longest == 0 or best[a] == float("inf"):
                continue
            v = best[a] + cost[j - a][min(longest, len(cost[1]) - 1)]
            if v < best[j]:
                best[j], back[j] = v, (a, True)
    segments = []
    j = span
    while j > 0:
        a, is_pass = back[j]
        if is_pass:
            segments.append((a, j))
        j = a
    return segments[::-1]
