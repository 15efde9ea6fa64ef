"""What a request's drafts are worth and what a pass costs: the prices behind the serving
rule (draft_plan.py), from measured costs, so never slower.

A request whose proposer drafts k tokens with per-token acceptance alpha, and finds a draft at
all with probability p, emits on average

    E(k) = 1 + p * (alpha + alpha^2 + ... + alpha^k)       (accepted + the bonus/recovered)

tokens per step (EAGLE-3 reference, section 7). Drafting itself costs d seconds per token
(measured per request: ~0 for n-grams, real for a draft model), D(k) = k * d. A pass over B rows
padded to T = 1 + k tokens costs c(B, T) (`StepCostModel`), measured at start-up over the batch
sizes and lengths that can occur and then following the measured pass times (exponential
moving average), so that it tracks the real machine, context growth included. The serving
step's pass is ragged (no padding): B requests with N queries in all (roots and draft tokens)
cost what the padded pass of as many queries does, c(B, N / B) (`ragged_cost`). As the
batch grows, that price per query rises against the tokens per plain pass (the pass is
compute-bound), so drafting pays less and speculation switches itself off where it stops
paying and comes back when the batch shrinks. draft_plan.py chooses each row's k from these
prices.

alpha and p are per request: counts of accepted / tried drafts with exponential forgetting,
starting from priors that are the server-wide estimates so far (pooled over every request,
forgetting slowly). While a request is not speculating, a cheap proposer still drafts in the
shadow: the draft is not verified but compared with the tokens the target emits next, which
measures its acceptance for free (exactly, for greedy decoding; for sampling, a point-mass
draft matches the sampled token with its acceptance probability). Cheap means at most
SHADOW_SHARE of the request's plain steps: an n-gram lookup shadows every step, a proposer up
to SHADOW_MAX_GAP times dearer once every few steps (`shadow_gap`: suffix decoding in a step
of 16 requests, whose confidence in its continuations then keeps learning while nothing
drafts). Shadows do not calibrate tree prices (below): on MT-Bench at 16 requests they put a
request's calibration at 1.2-1.4 where its verified trees realised 0.99x their modelled
tokens, and priced so it drafted where drafts did not pay. An expensive proposer is not
asked; its estimate relaxes back toward its prior, and the scheduler's draft probes (one
verified draft token per request, after 32, 64, ... 1024 plain steps: scheduler.py) measure it
again. The drafting cost d is timed per `propose` call, except calls that first caught up over
more tokens than one step emits (the prompt, or a run of plain steps: executor.py).

A tree proposer (EAGLE-3 with a measured tree, with or without an n-gram branch, suffix
decoding) is not a chain: k budget nodes spread over a few levels, and a step accepts whichever
branch the target agrees with. Such a proposer prices its own tree (`TreePricing`): E_i(k) is
its expected tokens per step for a k-node tree (EAGLE-3: from its acceptance statistics by rank
and depth, sizing.py; suffix decoding: from the candidates it holds for the request's text
now), and D_i(k) its modelled drafting time for that tree (one head pass per level), scaled by
the ratio of measured to modelled drafting time (catch-up and Python included). The chain
model's alpha would credit one candidate per level only and undercount a tree. Its expected
accepted tokens are calibrated against what verification realises: each verified tree adds
the accepted tokens its proposer expected for it and the tokens accepted, and E_i(k) - 1 is
scaled by realised / expected (per request, seeded from the server-wide ratio). A proposer
that found nothing expected nothing, so the calibration also covers how often it drafts.

Which rows draft how much: draft_plan.py.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

from eyas.engine.speculative.draft import DraftTree

SHADOW_SHARE = 0.02  # shadow drafting may cost at most this share of a request's plain steps
SHADOW_MAX_GAP = 8  # plain steps between two shadow drafts of a dearer proposer, at most

if TYPE_CHECKING:
    from eyas.engine.target import Target


class TreePricing(Protocol):
    """What a tree proposer knows of the tree it would draft under a budget of k nodes."""

    def expected_tokens(self, max_nodes: int) -> float | None:
        """Tokens per step, bonus included, when it drafts; None: it cannot tell (no statistics
        or no measured costs), and the chain model applies."""

    def draft_seconds(self, max_nodes: int) -> float:
        """Modelled seconds of drafting that tree."""


def tree_pricing(proposer: object) -> TreePricing | None:
    """The proposer as a TreePricing when it can price its trees, else None."""
    if hasattr(proposer, "expected_tokens") and hasattr(proposer, "draft_seconds"):
        return proposer  # type: ignore[return-value]
    return None


@dataclass
class AcceptanceEstimate:
    """Running per-token acceptance (alpha) and draft availability (p) of one request."""

    prior_alpha: float = 0.5
    prior_availability: float = 0.5
    prior_weight: float = 2.0  # pseudo-observations behind each prior
    forgetting: float = 0.9  # weight kept by old evidence at each new observation
    relax_rate: float = 0.98  # evidence kept per plain step (drifts back to the prior)
    accepted: float = 0.0  # accepted draft tokens (decayed)
    trials: float = 0.0  # accept/reject decisions (decayed)
    found: float = 0.0  # steps where the proposer drafted something (decayed)
    asked: float = 0.0  # steps where it was asked to (decayed)
    draft_seconds_per_token: float = 0.0  # EMA of the proposer's cost per draft token
    draft_calibration: float = 1.0  # EMA of measured / modelled drafting time (tree proposers)
    tree: TreePricing | None = None  # the request's proposer, when it prices its trees
    prior_calibration: float = 1.0  # realised / expected accepted tokens of its trees, a priori
    calibration_weight: float = 2.0  # expected tokens behind that prior
    expected_accepted: float = 0.0  # accepted tokens its verified trees were priced at (decayed)
    realised_accepted: float = 0.0  # accepted tokens they realised (decayed)
    pending_expected: float | None = None  # the tree being verified: its expected accepted tokens

    @property
    def alpha(self) -> float:
        return ((self.accepted + self.prior_alpha * self.prior_weight)
                / (self.trials + self.prior_weight))

    @property
    def availability(self) -> float:
        return ((self.found + self.prior_availability * self.prior_weight)
                / (self.asked + self.prior_weight))

    @property
    def calibration(self) -> float:
        """Realised / expected accepted tokens of this request's verified trees."""
        return ((self.realised_accepted + self.prior_calibration * self.calibration_weight)
                / (self.expected_accepted + self.calibration_weight))

    def seeded(self) -> AcceptanceEstimate:
        """A fresh estimate whose priors are this one's current values (a new request starts
        from what the server has seen so far)."""
        return AcceptanceEstimate(prior_alpha=self.alpha, prior_availability=self.availability,
                                  draft_seconds_per_token=self.draft_seconds_per_token,
                                  draft_calibration=self.draft_calibration,
                                  prior_calibration=self.calibration)

    def quote(self, k: int) -> tuple[float, float, float]:
        """(E(k), D(k), Q(k)) of a budget of k draft tokens, Q the draft queries it adds to the
        pass on average: the tree's own price where the proposer gives one (its expected
        accepted tokens calibrated; it drafts that tree: k queries), else the chain model's (a
        chain proposer that finds no draft, an n-gram lookup without a match, adds no query:
        availability x k queries on average)."""
        if k >= 1 and self.tree is not None:
            tree_tokens = self.tree.expected_tokens(k)
            if tree_tokens is not None:
                accepted = min(self.calibration * max(tree_tokens - 1.0, 0.0), float(k))
                return (1.0 + accepted, self.tree.draft_seconds(k) * self.draft_calibration, float(k))
        alpha = min(self.alpha, 0.999)
        availability = self.availability
        return (1.0 + availability * sum(alpha ** j for j in range(1, k + 1)),
                k * self.draft_seconds_per_token, availability * k)

    def expected_tokens(self, k: int) -> float:
        return self.quote(k)[0]

    def record(self, drafted_depth: int, accepted: int) -> None:
        """One verification of a chain (or the deepest path) of `drafted_depth` tokens."""
        self.asked = self.asked * self.forgetting + 1.0
        self.found = self.found * self.forgetting + (1.0 if drafted_depth else 0.0)
        if drafted_depth:
            trials = accepted + (1 if accepted < drafted_depth else 0)  # geometric MLE
            self.accepted = self.accepted * self.forgetting + accepted
            self.trials = self.trials * self.forgetting + trials

    def record_tree(self, expected: float, accepted: int) -> None:
        """One verified tree: the accepted tokens it was priced at (uncalibrated) and those
        verification accepted."""
        self.expected_accepted = self.expected_accepted * self.forgetting + max(expected, 0.0)
        self.realised_accepted = self.realised_accepted * self.forgetting + accepted

    def record_draft_time(self, seconds: float, tokens: int) -> None:
        if tokens:
            per_token = seconds / tokens
            previous = self.draft_seconds_per_token
            self.draft_seconds_per_token = per_token if previous == 0.0 else 0.8 * previous + 0.2 * per_token

    def record_draft_calibration(self, measured: float, modelled: float) -> None:
        """A tree proposer's measured drafting time beside its modelled time for the same tree."""
        if measured > 0 and modelled > 0:
            self.draft_calibration = 0.8 * self.draft_calibration + 0.2 * (measured / modelled)

    def relax(self) -> None:
        for name in ("accepted", "trials", "found", "asked", "expected_accepted", "realised_accepted"):
            setattr(self, name, getattr(self, name) * self.relax_rate)


def shadow_gap(cost: float, share: float) -> int | None:
    """Plain steps from one shadow draft of `cost` seconds to the next that keep its cost
    within `share` seconds a step (1: every step); None when that takes more than
    SHADOW_MAX_GAP steps (the proposer is not asked in the shadow)."""
    if cost <= share:
        return 1
    if share <= 0:
        return None
    gap = math.ceil(cost / share)
    return gap if gap <= SHADOW_MAX_GAP else None


@dataclass
class ShadowDraft:
    """A draft proposed during plain steps and checked against what the target emits next.
    A proposer that learns from verified trees (suffix decoding: `learn(nodes, accepted)`)
    hands its record of the tree's nodes (`drafted_nodes`); once resolved, `branch_lesson` is
    what verifying the first branch would have told it."""

    tokens: list[int] = field(default_factory=list)  # the draft's first branch
    matched: int = 0  # leading draft tokens the target has emitted so far
    branch: list[int] = field(default_factory=list)  # node ids (1-based) of the first branch
    nodes: list | None = None  # the proposer's record of the tree's nodes, in node order
    wait: int = 0  # plain steps before the next shadow draft may start (`shadow_gap`)

    @property
    def active(self) -> bool:
        return bool(self.tokens)

    def start(self, tree: DraftTree, nodes: list | None = None) -> None:
        self.branch = first_branch_nodes(tree)
        self.tokens, self.matched = [int(tree.tokens[i - 1]) for i in self.branch], 0
        self.nodes = nodes if nodes is not None and len(nodes) == tree.size else None

    def follow(self, emitted: list[int]) -> tuple[int, int] | None:
        """Feed the tokens a step emitted; (drafted, accepted) once the draft is resolved."""
        for token in emitted:
            if token != self.tokens[self.matched]:
                return self.clear()
            self.matched += 1
            if self.matched == len(self.tokens):
                return self.clear()
        return None

    def clear(self) -> tuple[int, int]:
        outcome = (len(self.tokens), self.matched)
        self.tokens, self.matched, self.branch, self.nodes = [], 0, [], None
        return outcome


def branch_lesson(nodes: list, branch: list[int], accepted: int) -> tuple[list, list[int]]:
    """For a proposer's `learn(nodes, accepted_nodes)`: its nodes with None off the first
    branch (never verified: no trials), and the branch's first `accepted` node ids."""
    on_branch = [None] * len(nodes)
    for node in branch:
        on_branch[node - 1] = nodes[node - 1]
    return on_branch, branch[:accepted]


def first_branch_nodes(tree: DraftTree) -> list[int]:
    """Node ids (1-based) along the first child of the root, then of that child, and so on."""
    parents = tree.parents.tolist()
    path, node = [], 0
    while (child := next((i + 1 for i, p in enumerate(parents) if p == node), None)) is not None:
        path.append(child)
        node = child
    return path


def first_branch(tree: DraftTree) -> list[int]:
    """Tokens along the first branch (`first_branch_nodes`)."""
    tokens = tree.tokens.tolist()
    return [tokens[node - 1] for node in first_branch_nodes(tree)]


class StepCostModel:
    """Seconds of one decode pass with B rows of T tokens: c(B, T), measured, interpolated."""

    def __init__(self, batch_sizes: Sequence[int], table: dict[tuple[int, int], float],
                 max_tokens_per_row: int, smoothing: float = 0.25) -> None:
        self.batch_sizes = sorted(batch_sizes)  # grid of B
        self.table = dict(table)  # (B, T) -> seconds, for every grid B and T in 1..max
        self.max_tokens_per_row = max_tokens_per_row
        self.smoothing = smoothing

    def _neighbours(self, batch: int) -> tuple[int, int, float]:
        grid = self.batch_sizes
        if batch <= grid[0]:
            return grid[0], grid[0], 0.0
        if batch >= grid[-1]:
            return grid[-1], grid[-1], 0.0
        upper = grid[bisect_left(grid, batch)]
        lower = grid[bisect_left(grid, batch) - 1]
        return lower, upper, (batch - lower) / (upper - lower) if upper != lower else 0.0

    def cost(self, batch: int, tokens_per_row: int) -> float:
        tokens = min(max(tokens_per_row, 1), self.max_tokens_per_row)
        lower, upper, weight = self._neighbours(batch)
        value = (1 - weight) * self.table[(lower, tokens)] + weight * self.table[(upper, tokens)]
        largest = self.batch_sizes[-1]
        if batch > largest:  # beyond the grid: grows in proportion to the rows
            value *= batch / largest
        return value

    def ragged_cost(self, sequences: int, queries: int) -> float:
        """Seconds of a ragged pass over `sequences` requests with `queries` queries in all
        (their roots and draft nodes, no padding): what the padded pass of as many queries
        costs, c(B, N / B), interpolated between whole T (past the longest T measured, at the
        last step's slope)."""
        tokens = max(queries / sequences, 1.0)
        longest = self.max_tokens_per_row
        whole = min(int(tokens), longest)
        low = self.cost(sequences, whole)
        if tokens == whole:
            return low
        step = (self.cost(sequences, whole + 1) if whole < longest else
                low + (low - self.cost(sequences, whole - 1) if whole > 1 else low)) - low
        return low + (tokens - whole) * step

    def observe_ragged(self, sequences: int, queries: int, seconds: float) -> None:
        """Pull the cells of B = `sequences` (every T: the machine's speed and the context's
        length move them together) toward a measured ragged pass time."""
        predicted = self.ragged_cost(sequences, queries)
        if predicted <= 0 or seconds <= 0:
            return
        ratio = 1.0 + self.smoothing * (seconds / predicted - 1.0)
        lower, upper, _ = self._neighbours(sequences)
        for grid_batch in {lower, upper}:
            for tokens in range(1, self.max_tokens_per_row + 1):
                self.table[(grid_batch, tokens)] *= ratio

    @classmethod
    def measure(cls, target: Target, batch_sizes: Sequence[int], max_tokens_per_row: int,
                context: int = 64, rounds: int = 3) -> StepCostModel:
        """Time the executor's greedy pass for every B in `batch_sizes` and T in 1..max over a
        `context`-token cache of text (pass_costs.py: how, and why text), then make the table
        monotone."""
        from eyas.scheduler.pass_costs import measure_pass_costs

        table = measure_pass_costs(target, batch_sizes, max_tokens_per_row, context, rounds)
        return cls(batch_sizes, monotone(table, sorted(batch_sizes), max_tokens_per_row),
                   max_tokens_per_row)

    def as_dict(self) -> dict[str, float]:
        return {f"B={b},T={t}": round(s * 1000, 3) for (b, t), s in sorted(self.table.items())}


def monotone(table: dict[tuple[int, int], float], batch_sizes: list[int], max_tokens: int
             ) -> dict[tuple[int, int], float]:
    """A pass never costs more than a larger one: noise on a shared machine only ever adds
    time, so each cell is capped by the cells of larger T and larger B (a running minimum from
    the largest shape down)."""
    fixed = dict(table)
    for batch in batch_sizes:
        for tokens in range(max_tokens - 1, 0, -1):
            fixed[(batch, tokens)] = min(fixed[(batch, tokens)], fixed[(batch, tokens + 1)])
    for tokens in range(1, max_tokens + 1):
        for smaller, larger in reversed(list(zip(batch_sizes, batch_sizes[1:]))):
            fixed[(smaller, tokens)] = min(fixed[(smaller, tokens)], fixed[(larger, tokens)])
    return fixed
