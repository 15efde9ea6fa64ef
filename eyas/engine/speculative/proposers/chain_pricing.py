"""How long a draft model's chain should be in single-stream decoding, priced from measurement.

A chain of L draft tokens costs L draft passes (the catch-up pass that yields the first draft,
then one per further draft) and one target pass over T = L + 1 tokens; it yields
1 + r1 + r1 r2 + ... + r1..rL tokens, r_j being the observed rate at which the j-th draft is
accepted once the one before it was (ngram.BranchStats, decaying toward its prior). The whole
budget is drafted wherever it beats a plain step (so that every position's rate keeps being
observed: priced on rates seen only in short chains, a long chain's later drafts would keep
their prior and chains would stay short where long ones pay); otherwise the length with the
most expected tokens per second, down to L = 0, a plain step, which is what a pair that cannot
pay gets.

The prices: the target's pass over T tokens and the draft's pass over one token, each measured
once per machine, model and precision (sizing.load_or_measure, cached), then scaled by what
this decoding measures (`ChainPricing.measured`: plain steps, the verification part of
speculative steps, draft passes), so that a busy machine, whose passes all run slower, moves
the prices together. Where the pair could pay at all (`could_pay`: at 90% acceptance), the
first `explore_steps` steps draft the whole budget, as does the first step of each request
(acceptance differs from prompt to prompt) and one step after `probe_every` plain ones, so
that a pair priced out on one stretch of text is tried again on the next.

Acceptance is learned across requests: every chain is also counted in `history`, a slowly
decaying estimate per position over all the requests this pricing has seen, and the per-request
rates decay toward it (not toward a fixed prior), so that a new request starts from what the
pair has done on this stream: on text where it has not paid, the first step is plain.

A pair priced out must cost next to nothing: a request that begins while the prices say no
chain pays, or that the best pays less than `start_margin` (too little to earn back the draft's
read of a whole prompt), neither explores nor has the draft read its prompt (the draft catches
up when it first drafts, over a window of the context: draft_model.py), and each probe after
which the prices still say no waits twice as long for the next (up to `max_probe_every` plain
steps). The wait and the plain steps toward it carry over to the next request while the pair
stays priced out (one probe every `max_probe_every` steps of the stream, whatever the length of
its requests); a request that begins with a paying chain, or a chain that pays, starts again
from `probe_every`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eyas.engine.speculative.proposers.ngram import BranchStats
from eyas.engine.speculative.sizing import CostModel, best_prefix

LONGEST = 16  # the longest chain priced
RATIO_KINDS = ("plain", "verify", "draft")
PRIOR = (0.7, 0.8)  # P(accepted) of a draft model's first token; each later one, before any chain
HISTORY_KEPT = 0.98  # evidence `history` keeps per chain (~50 chains)


@dataclass
class ChainPricing:
    cost: CostModel  # the target's pass over T tokens (T = 1..64), seconds
    draft_pass: float  # seconds of one draft pass over one token after a context, measured alike
    explore_steps: int = 3  # steps that draft the whole budget before any price is trusted
    probe_every: int = 16  # plain steps in a row after which one step drafts the whole budget
    max_probe_every: int = 128  # the longest wait between probes that found no paying chain
    # a request's draft reads the whole prompt (and explores) only where the best chain is
    # priced at least this much faster than plain: the draft's prefill is a third of the target's
    start_margin: float = 1.1
    # P(a draft model's token accepted): the first; each later one once the one before was
    acceptance: BranchStats = field(default_factory=lambda: BranchStats(LONGEST, prior=PRIOR,
                                                                        relax_rate=0.95))
    # the same over every request seen (the prior `acceptance` decays toward), per chain
    history: BranchStats = field(default_factory=lambda: BranchStats(LONGEST, prior=PRIOR,
                                                                     relax_rate=HISTORY_KEPT))
    ratios: dict[str, float] = field(default_factory=dict)  # measured / modelled, by RATIO_KINDS
    explored: int = 0
    plain_in_a_row: int = 0
    probe_wait: int = 0  # plain steps before the next probe (0: probe_every)

    def __post_init__(self) -> None:
        if self.draft_pass <= 0 or self.cost.verify(1) <= 0:
            raise ValueError("a chain is priced from positive pass times")
        if self.start_margin < 1:
            raise ValueError("start_margin must be at least 1 (a chain that pays)")
        if not 1 <= self.probe_every <= self.max_probe_every:
            raise ValueError("probe_every must be at least 1 and at most max_probe_every")
        self.probe_wait = self.probe_wait or self.probe_every

    def measured(self, kind: str, seconds: float, modelled: float) -> None:
        """A measured time of what the cost model prices at `modelled` seconds (a running ratio)."""
        assert kind in RATIO_KINDS, kind
        if seconds <= 0 or modelled <= 0:
            return
        ratio = seconds / modelled
        previous = self.ratios.get(kind)
        self.ratios[kind] = ratio if previous is None else 0.8 * previous + 0.2 * ratio

    def record(self, drafted: int, accepted: int) -> None:
        """A chain of `drafted` tokens, of which the first `accepted` were accepted."""
        self.acceptance.record(drafted, accepted)
        self.history.relax()
        self.history.record(drafted, accepted)
        self.acceptance.prior = tuple(self.history.rate(j) for j in range(LONGEST))

    def relax(self) -> None:
        """A step went by: this request's evidence decays toward the learned rates."""
        self.acceptance.relax()

    def draft_seconds(self) -> float:
        """One draft pass, as this decoding measures it."""
        return self.draft_pass * self.ratios.get("draft", self.ratios.get("plain", 1.0))

    def calibrated(self) -> CostModel:
        """The target's cost model scaled to what plain and speculative steps measured."""
        plain = self.ratios.get("plain", 1.0)
        return self.cost.calibrated(plain, self.ratios.get("verify", plain))

    def on_path(self, max_nodes: int, rates: list[float] | None = None) -> list[float]:
        """P(the j-th draft of a chain is accepted), j = 1..min(max_nodes, LONGEST): at the
        observed rates, or at `rates` (per position, the last for all later ones)."""
        on_path, reach = [], 1.0
        for j in range(min(max_nodes, LONGEST)):
            reach *= self.acceptance.rate(j) if rates is None else rates[min(j, len(rates) - 1)]
            on_path.append(reach)
        return on_path

    def best_length(self, max_nodes: int, rates: list[float] | None = None) -> int:
        """The whole budget where it beats a plain step, else the chain length (0..max_nodes)
        with the most expected tokens per second."""
        on_path = self.on_path(max_nodes, rates)
        cost, draft = self.calibrated(), self.draft_seconds()
        whole = len(on_path)
        if whole and (1 + sum(on_path)) / (cost.verify(whole + 1) + whole * draft) > 1 / cost.verify(1):
            return whole
        return best_prefix(on_path, cost, draft_per_token=draft)

    def speed_up(self, max_nodes: int) -> float:
        """Expected tokens per second of the best chain (1..max_nodes) over a plain step's, at
        the observed rates and measured prices (1.0 where no chain beats plain)."""
        on_path, cost, draft = self.on_path(max_nodes), self.calibrated(), self.draft_seconds()
        length = best_prefix(on_path, cost, draft_per_token=draft)  # 0: plain, a speed-up of 1.0
        return (1 + sum(on_path[:length])) * cost.verify(1) / (cost.verify(length + 1) + length * draft)

    def could_pay(self, max_nodes: int, rate: float = 0.9) -> bool:
        """Whether some chain pays if `rate` of each position's drafts were accepted."""
        return self.best_length(max_nodes, [rate]) > 0

    def new_request(self, max_nodes: int) -> bool:
        """A request begins: its first step explores where the pair could pay and the prices
        (the learned acceptance included) do not say that no chain pays (a pair never measured
        is trusted). Returns whether it explores. Priced out, the probes' wait carries over
        from the last request."""
        if not self.could_pay(max_nodes):
            return False
        if "draft" in self.ratios and self.speed_up(max_nodes) < self.start_margin:
            # no chain pays, or too little to be worth exploring with whole-budget chains: no
            # exploring step; a chain priced to pay still drafts (draft_model.py)
            self.explored = max(self.explored, self.explore_steps)
            return False
        self.probe_wait, self.plain_in_a_row = self.probe_every, 0
        self.explored = min(self.explored, self.explore_steps - 1)
        return True

    def length(self, max_nodes: int) -> int:
        """The chain to draft now: the whole budget while exploring or probing, else the
        priced length."""
        probe_due = self.plain_in_a_row >= self.probe_wait
        exploring = self.explored < self.explore_steps or probe_due
        # a probe also re-measures a draft priced out by what it measured (a busy moment can
        # price one draft pass above a target pass); one never measured is trusted
        probing = probe_due and "draft" in self.ratios
        if exploring and (probing or self.could_pay(max_nodes)):
            self.explored += 1
            self.plain_in_a_row = 0
            if probe_due:  # the next probe waits longer, unless a chain pays before it
                self.probe_wait = min(2 * self.probe_wait, self.max_probe_every)
            return max_nodes
        length = self.best_length(max_nodes)
        self.plain_in_a_row = 0 if length else self.plain_in_a_row + 1
        if length:
            self.probe_wait = self.probe_every
        return length

    def stats(self) -> dict:
        return {"acceptance_rates": [round(self.acceptance.rate(j), 3) for j in range(8)],
                "cost_ratios": {kind: round(value, 3) for kind, value in self.ratios.items()},
                "draft_pass_ms": round(self.draft_seconds() * 1e3, 2),
                "verify_1_ms": round(self.calibrated().verify(1) * 1e3, 2)}
