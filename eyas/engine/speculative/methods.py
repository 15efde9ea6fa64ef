"""`--draft` specs -> proposers. A plain dict is the registry of drafting methods.

Accepted: none | ngram[:MAX_N[,MIN_N[,MATCHES]]] | model:PATH_OR_ALIAS | self
"""

from __future__ import annotations

from typing import Callable

from eyas.engine.speculative.proposers.base import Proposer
from eyas.engine.target import Target
from eyas.errors import EyasError


def _ngram(target: Target, option: str) -> Proposer:
    from eyas.engine.speculative.proposers.ngram import NgramConfig, NgramProposer

    numbers = [int(x) for x in option.split(",")] if option else []
    keys = ["max_n", "min_n", "max_matches"]
    return NgramProposer(NgramConfig(**dict(zip(keys, numbers))))


def _model(target: Target, option: str) -> Proposer:
    from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
    from eyas.engine.target import load_target

    if not option:
        raise EyasError("--draft model needs a model: model:PATH_OR_ALIAS")
    precision = "float32" if target.precision == "int4" else target.precision
    draft = load_target(option, dtype=precision, device=str(target.device))
    return DraftModelProposer(draft, name="model")


def _self(target: Target, option: str) -> Proposer:
    from eyas.engine.speculative.proposers.draft_model import DraftModelProposer

    return DraftModelProposer(target, name="self")


METHODS: dict[str, Callable[[Target, str], Proposer]] = {
    "ngram": _ngram,
    "model": _model,
    "self": _self,
}


def build_proposer(spec: str, target: Target) -> Proposer | None:
    """None for 'none'; otherwise the proposer named by `spec`."""
    name, _, option = spec.partition(":")
    if name == "none":
        return None
    if name not in METHODS:
        raise EyasError(f"unknown draft method '{spec}'; accepted: none, "
                        "ngram[:MAX_N[,MIN_N[,MATCHES]]], model:PATH_OR_ALIAS, self")
    try:
        return METHODS[name](target, option)
    except ValueError as error:
        raise EyasError(f"bad --draft '{spec}': {error}") from error
