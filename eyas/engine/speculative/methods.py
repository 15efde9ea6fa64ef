"""`--draft` specs -> proposers. A plain dict is the registry of drafting methods.

Accepted: none | ngram[:MAX_N[,MIN_N[,MATCHES]]] | model:PATH_OR_ALIAS[@DTYPE] | self | eagle3:DIR
| medusa:DIR | layerskip[:auto|LAYERS[:MIN_CONFIDENCE]]   (docs/drafting-methods.md)
| suffix[:CACHE_MB[,MAX_DEPTH]]
and eagle3:DIR+ngram[:MAX_N[,MIN_N[,GRAFT_TOKENS]]]: prompt lookup grafted onto the head's tree,
and eagle3:DIR+suffix[:CACHE_MB[,MAX_DEPTH]]: suffix decoding grafted onto the head's tree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from eyas.engine.speculative.proposers.base import Proposer
from eyas.engine.target import Target
from eyas.errors import EyasError


def _ngram(target: Target, option: str, tree: str | None) -> Proposer:
    from eyas.engine.speculative.proposers.ngram import NgramConfig, NgramProposer

    numbers = [int(x) for x in option.split(",")] if option else []
    keys = ["max_n", "min_n", "max_matches"]
    # priced: in single-stream decoding the draft is cut where it pays (proposers/ngram.py);
    # the serving engine prices its steps itself and never hands the proposer costs
    return NgramProposer(NgramConfig(**dict(zip(keys, numbers)), priced=True))


def _suffix(target: Target, option: str, tree: str | None) -> Proposer:
    from eyas.engine.speculative.proposers.suffix import SuffixConfig, SuffixProposer

    return SuffixProposer(SuffixConfig.parse(option))


def draft_model_precision(target: Target, option: str) -> tuple[str, str]:
    """'PATH_OR_ALIAS[@DTYPE]' -> (path or alias, precision). Without '@DTYPE' the draft runs as
    the target does: int4 beside an int4 target (a draft must read far fewer bytes per token than
    the target to pay, docs/bring-your-own-target.md), the target's precision otherwise."""
    from eyas.engine.target import PRECISIONS

    path, at, precision = option.rpartition("@")
    if not at:
        return option, target.precision
    if precision not in PRECISIONS:
        raise EyasError(f"bad draft precision '@{precision}' in model:{option}; accepted: "
                        f"{', '.join(PRECISIONS)}")
    return path, precision


DRAFT_VOCABULARY = 65536  # token ids a draft model's greedy drafts choose from (with the special ones)


def _model(target: Target, option: str, tree: str | None) -> Proposer:
    from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
    from eyas.engine.target import load_target

    if not option:
        raise EyasError("--draft model needs a model: model:PATH_OR_ALIAS[@DTYPE]")
    path, precision = draft_model_precision(target, option)
    draft = load_target(path, dtype=precision, device=str(target.device))
    # the chain sized from measured costs; greedy drafts over the first 65,536 token ids (and the
    # special tokens) where the vocabulary is twice that or more (proposers/draft_vocabulary.py)
    return DraftModelProposer(draft, name="model", priced=True, vocabulary_size=DRAFT_VOCABULARY)


def _self(target: Target, option: str, tree: str | None) -> Proposer:
    from eyas.engine.speculative.proposers.draft_model import DraftModelProposer

    return DraftModelProposer(target, name="self", priced=True)  # never pays: plain, with the fallback on


def _eagle3(target: Target, option: str, tree: str | None) -> Proposer:
    from eyas.eagle3 import load_head
    from eyas.eagle3.shipped import SHIPPED_HEADS, shipped_head_dir
    from eyas.engine.speculative.proposers.eagle3 import Eagle3Proposer, TreeShape
    from eyas.models.quant import quantize_linears

    if not option:
        raise EyasError("--draft eagle3 needs a head: eagle3:DIR (a head folder) or "
                        f"eagle3:NAME (a shipped head: {', '.join(SHIPPED_HEADS)})")
    if not Path(option).exists() and shipped_head_dir(option) is not None:
        option = str(shipped_head_dir(option))
    head = load_head(option, embedding=target.model.embed_tokens.weight, device=target.device,
                     dtype=torch.float32 if target.precision == "int4" else target.dtype)
    if head.config.target_num_hidden_layers not in (None, target.config.num_hidden_layers):
        raise EyasError(f"the head in {option} was trained for a target with "
                        f"{head.config.target_num_hidden_layers} layers; this one has "
                        f"{target.config.num_hidden_layers}")
    if target.precision == "int4":  # the head's weights in int4 too: its passes cost their bytes
        quantize_linears(head)
    return Eagle3Proposer(head, TreeShape.parse(tree) if tree and tree != "auto" else None)


def _medusa(target: Target, option: str, tree: str | None) -> Proposer:
    from eyas.engine.speculative.proposers.medusa import build_medusa

    return build_medusa(target, option, tree)


def _layerskip(target: Target, option: str, tree: str | None) -> Proposer:
    from eyas.engine.speculative.proposers.layerskip import build_layerskip

    return build_layerskip(target, option)


METHODS: dict[str, Callable[[Target, str, str | None], Proposer]] = {
    "eagle3": _eagle3,
    "medusa": _medusa,
    "layerskip": _layerskip,
    "ngram": _ngram,
    "suffix": _suffix,
    "model": _model,
    "self": _self,
}

ACCEPTED = ("none, ngram[:MAX_N[,MIN_N[,MATCHES]]], model:PATH_OR_ALIAS[@DTYPE], self, eagle3:DIR|NAME, "
            "medusa:DIR, layerskip[:auto|LAYERS[:MIN_CONFIDENCE]], suffix[:CACHE_MB[,MAX_DEPTH]], "
            "eagle3:DIR|NAME+ngram[:MAX_N[,MIN_N[,GRAFT_TOKENS]]], "
            "eagle3:DIR|NAME+suffix[:CACHE_MB[,MAX_DEPTH]]")


def split_graft(spec: str, marker: str = "+ngram") -> tuple[str, str | None]:
    """'eagle3:DIR+ngram:3,2,4' -> ('eagle3:DIR', '3,2,4'); no `marker` -> (spec, None)."""
    main, plus, rest = spec.rpartition(marker)
    if not plus or (rest and not rest.startswith(":")) or not main:
        return spec, None
    return main, rest[1:]


def split_suffix_graft(spec: str) -> tuple[str, str | None]:
    """'eagle3:DIR+suffix:256' -> ('eagle3:DIR', '256'); no '+suffix' -> (spec, None)."""
    return split_graft(spec, "+suffix")


def _ngram_graft(main: Proposer, option: str) -> Proposer:
    from eyas.engine.speculative.proposers.graft import NgramGraftProposer

    keys = ["max_n", "min_n", "graft_tokens"]
    try:
        numbers = [int(x) for x in option.split(",")] if option else []
        if len(numbers) > len(keys):
            raise ValueError(option)
    except ValueError:
        raise EyasError(f"bad '+ngram:{option}'; accepted: +ngram[:MAX_N[,MIN_N[,GRAFT_TOKENS]]]") from None
    return NgramGraftProposer(main, **dict(zip(keys, numbers)))


def _suffix_graft(main: Proposer, option: str) -> Proposer:
    from eyas.engine.speculative.proposers.suffix import SuffixConfig, SuffixProposer
    from eyas.engine.speculative.proposers.suffix_graft import SuffixGraftProposer

    return SuffixGraftProposer(main, SuffixProposer(SuffixConfig.parse(option)))


# '+X' suffixes of --draft: (builder, the method to use for X alone); the last one in the spec
# is outermost ('+suffix' is looked for first, as before).
GRAFTS: dict[str, tuple[Callable[[Proposer, str], Proposer], str]] = {
    "+suffix": (_suffix_graft, "--draft suffix"),
    "+ngram": (_ngram_graft, "--draft ngram"),
}


def build_proposer(spec: str, target: Target, tree: str | None = None) -> Proposer | None:
    """None for 'none'; otherwise the proposer named by `spec`.

    `tree` (EAGLE-3 and Medusa): 'auto', 'chain:K' or 'DEPTH,TOPK,TOTAL'.
    A '+ngram[:MAX_N,MIN_N,GRAFT_TOKENS]' suffix grafts prompt lookup onto an EAGLE-3 tree,
    a '+suffix[:CACHE_MB[,MAX_DEPTH]]' one suffix decoding.
    """
    for marker, (graft, alone) in GRAFTS.items():
        main_spec, option = split_graft(spec, marker)
        if option is None:
            continue
        main = build_proposer(main_spec, target, tree)
        if main is None:
            raise EyasError(f"'{marker}' needs a method to graft onto, e.g. "
                            f"eagle3:smollm2-135m{marker} (for {marker[1:]} alone: {alone})")
        return graft(main, option)
    name, _, option = spec.partition(":")
    if name == "none":
        return None
    if name not in METHODS:
        raise EyasError(f"unknown draft method '{spec}'; accepted: {ACCEPTED}")
    try:
        return METHODS[name](target, option, tree)
    except ValueError as error:
        raise EyasError(f"bad --draft '{spec}': {error}") from error
