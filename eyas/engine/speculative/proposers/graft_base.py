"""`GraftedTree`: what a proposer that merges extra branches into a main tree (EAGLE-3) shares.

`X+ngram` (graft.py) and `X+suffix` (suffix_graft.py) both let the main proposer draft its tree
first, merge in nodes of their own, and, with measured costs, keep the prefix of the merged
nodes (ranked by their probability of lying on the accepted path) with the most expected tokens
per second. This base holds what does not depend on where the extra nodes come from: the
delegation to the main proposer (lifecycle, costs, pricing), the head nodes' path
probabilities from its rank statistics, and the cut.
"""

from __future__ import annotations

from eyas.engine.speculative.sizing import best_prefix
from eyas.errors import EyasError


class GraftedTree:
    """Base of the graft proposers; `self.main` is the tree-drafting proposer (EAGLE-3)."""

    suffix_name = "+graft"  # the method's suffix in --draft, for error messages

    def __init__(self, main, hint: str = "") -> None:
        if not hasattr(main, "renumber"):
            raise EyasError(f"'{self.suffix_name}' grafts onto a tree-drafting method that keeps "
                            f"its own statistics (eagle3); '{main.name}' cannot take it{hint}")
        self.main = main
        self.name = f"{main.name}{self.suffix_name}"
        self.tap_layers = tuple(main.tap_layers)
        self.taps_optional = getattr(main, "taps_optional", False)  # rows left out: see eagle3.py
        self.plain_allowed = False  # single_stream: the grafted nodes alone must beat a plain step
        self.grafted = 0  # nodes added to the main trees (statistics)

    # -- delegated to the main proposer -------------------------------------------------------
    def single_stream(self, target, fallback: bool = True) -> None:
        """Decoding one request: where the main proposer drafts nothing, the grafted nodes
        alone may also lose to a plain step (the serving engine decides budgets itself)."""
        if hasattr(self.main, "single_stream"):
            self.main.single_stream(target, fallback)
        self.plain_allowed = True

    def draw_with(self, coupling) -> None:
        """The request's tokens are Gumbel draws with known noise (coupled_draws.py): the main
        proposer ranks its drafts with it; the grafted branches are deterministic as they are."""
        if hasattr(self.main, "draw_with"):
            self.main.draw_with(coupling)

    def step_seconds(self, size: int, seconds: float) -> None:
        if hasattr(self.main, "step_seconds"):
            self.main.step_seconds(size, seconds)

    def draft_seconds_per_token(self, target) -> float:
        estimate = getattr(self.main, "draft_seconds_per_token", None)
        return float(estimate(target)) if estimate is not None else 0.0

    def draft_seconds(self, max_nodes: int) -> float:
        main = getattr(self.main, "draft_seconds", None)
        return main(max_nodes) if main is not None else 0.0

    # -- pricing ------------------------------------------------------------------------------
    def _can_price(self) -> bool:
        """Measured costs and rank statistics to price head nodes with (EAGLE-3, --tree auto);
        without them every grafted node that fits the budget is kept."""
        return (getattr(self.main, "cost", None) is not None
                and getattr(self.main, "choice", None) is not None and getattr(self.main, "auto", False))

    def _head_step(self, node: int) -> float:
        """P(head node `node` is accepted | its parent was), from the head's rank statistics."""
        ranks = self.main.ranks.probabilities
        rank = self.main.node_ranks[node - 1] if node - 1 < len(self.main.node_ranks) else 0
        return ranks[rank - 1] if 0 < rank <= len(ranks) else 0.0

    def _cut(self, on_path: list[float], main_size: int, max_nodes: int) -> list[int]:
        """The merged nodes worth verifying (ids in order, so parents first): ranked by
        `on_path` (index 0 = the root), cut where expected tokens per second peak, at most
        `max_nodes`. `main_size`: nodes the main proposer drafted itself."""
        cost, choice = self.main.cost, self.main.choice
        order = sorted(range(1, len(on_path)), key=lambda n: (-on_path[n], n))
        # the head's modelled drafting for this budget (the one the serving rule prices), or
        # its one catch-up pass where the chosen shape drafts nothing
        draft_seconds = self.main.draft_seconds(max_nodes) if choice.depth else cost.draft(1)
        plain = main_size == 0 and self.plain_allowed  # the head drafted nothing: the grafted
        if plain:  # nodes alone, against a plain step
            draft_seconds = 0.0
        count = best_prefix([on_path[n] for n in order[: max(max_nodes, 1)]], cost, draft_seconds,
                            plain)
        return sorted(order[:count])
