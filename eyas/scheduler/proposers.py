"""`--draft` spec -> a factory of per-request proposers for the serving engine.

Accepted specs: those of eyas.engine.speculative.methods (ACCEPTED there).
The drafting methods themselves live in eyas.engine.speculative (its METHODS dict is the one
registry): a prototype is built once (a draft model is loaded once), then every request gets a
shallow copy, which shares the weights and keeps its own state (`begin` resets it). A
proposer given as an object (single-stream decoding: `eyas.scheduler.single`) is served as it
is, to the one request of its engine.
`eagle3:DIR` takes its tree shape from `tree` (auto, chain:K or DEPTH,TOPK,TOTAL); the serving
policy caps each request's tree at the step's draft budget.
"""

from __future__ import annotations

import copy

from eyas.engine.speculative.methods import ACCEPTED, METHODS, build_proposer
from eyas.engine.speculative.proposers.base import Proposer
from eyas.engine.target import Target
from eyas.errors import EyasError



def check_spec(spec: str) -> str:
    """The method name of a --draft spec; raises EyasError for one that cannot be served."""
    name = spec.partition(":")[0]
    if name == "eagle3" and "eagle3" not in METHODS:
        raise EyasError("--draft eagle3:DIR needs the EAGLE-3 drafting method, which this "
                        f"build does not register yet; accepted now: {ACCEPTED}")
    if name not in ("none", *METHODS):
        raise EyasError(f"unknown draft method '{spec}'; accepted: {ACCEPTED}")
    return name


class ProposerFactory:
    def __init__(self, spec: str | Proposer, target: Target, max_slots: int, tree: str | None = None) -> None:
        self.shared = not isinstance(spec, str)  # an object: handed out itself, not copied
        if self.shared:
            self.spec = self.method = getattr(spec, "name", type(spec).__name__)
            prototype = spec
        else:
            self.spec = spec
            self.method = check_spec(spec)
            prototype = build_proposer(spec, target, tree=tree)
        if prototype is not None and hasattr(prototype, "slots") and not self.shared:
            prototype.slots = min(prototype.slots, max_slots)  # a draft cache per request
        self.prototype: Proposer | None = prototype

    @property
    def enabled(self) -> bool:
        return self.prototype is not None

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(self.prototype.tap_layers) if self.prototype is not None else ()

    def draft_seconds_per_token(self, target: Target) -> float:
        """What drafting one token is expected to cost before any request has drafted: the
        proposer's own start-up measurement where it has one (EAGLE-3: one head pass), else 0
        (n-gram lookup costs next to nothing; a draft model is measured on first use)."""
        estimate = getattr(self.prototype, "draft_seconds_per_token", None)
        return float(estimate(target)) if estimate is not None else 0.0

    def suffix_store(self):
        """The global store of suffix decoding (`suffix`, `X+suffix`), shared by every
        request; None for other methods."""
        prototype = self.prototype
        store = getattr(prototype, "store", None) or getattr(getattr(prototype, "suffix", None), "store", None)
        return store

    def new(self) -> Proposer | None:
        if self.prototype is None or self.shared:
            return self.prototype
        return copy.copy(self.prototype)
