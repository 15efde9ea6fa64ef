"""Lossless acceptance rules: the emitted tokens follow exactly the target's distribution.

- Greedy: accept the child equal to the target's argmax at its parent; the argmax after the
  last accepted node is the bonus (or, after a mismatch, the recovered) token.
- Chain with draft probabilities q (a sampled draft model): accept x with probability
  min(1, p(x) / q(x)); on rejection sample from norm(max(0, p - q)); bonus from p.
- Deterministic drafts (n-gram, argmax, top-k tree children) are point masses: at each node,
  visit children in order, accept child c with probability p(c) under the current p; on
  rejection set p(c) = 0 and renormalise; if no child is accepted, sample from what is left.
- Deterministic drafts with a draw per node (plain-temperature rows, engine/gumbel.py): draw
  x ~ p at the node; accept the child whose token is x, else x is the recovered (or, at a leaf,
  the bonus) token. Child c is accepted with probability p(c), as above, and the token emitted
  after rejecting every child follows p restricted to the other tokens: the same output
  distribution, with one draw per position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.engine.sampling import argmax_rows, sample_from
from eyas.engine.speculative.draft import DraftTree, VerifyResult
from eyas.engine.speculative.tree import children_of


def accept_greedy(tree: DraftTree, target_logits: Tensor) -> VerifyResult:
    """target_logits [N+1, V]: row 0 predicts the root's child, row i node i's child."""
    return _follow(tree, argmax_rows(target_logits).tolist())


def accept_drawn(tree: DraftTree, draws: list[int]) -> VerifyResult:
    """draws [N+1]: a sample of the target's distribution at row 0 (the root) and at each node,
    each drawn with the noise of the output position it would fill (engine/gumbel.py)."""
    assert tree.draft_probs is None, "drafts with draft probabilities take the p/q rule"
    return _follow(tree, draws)


def _follow(tree: DraftTree, choices: list[int]) -> VerifyResult:
    """From the root, accept the child whose token is the node's choice; the first node
    without one emits its choice (a bonus token at a leaf, a recovered one otherwise)."""
    children = children_of(tree)
    tokens = tree.tokens.tolist()
    node, path = 0, []
    while True:
        match = next((c for c in children.get(node, []) if tokens[c - 1] == choices[node]), None)
        if match is None:
            return VerifyResult(path, [tokens[n - 1] for n in path], choices[node],
                                is_bonus=node not in children)
        path.append(match)
        node = match


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device))


def _sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(sample_from(probs[None], generator)[0])


def accept_sampling(tree: DraftTree, target_probs: Tensor, generator: torch.Generator | None
                    ) -> VerifyResult:
    """target_probs [N+1, V] after temperature/top-k/top-p; exact for chains and top-k trees."""
    if tree.draft_probs is not None:
        return _accept_chain_with_q(tree, target_probs, generator)
    children = children_of(tree)
    tokens = tree.tokens.tolist()
    node, path = 0, []
    while True:
        kids = children.get(node, [])
        if not kids:  # a leaf (or the root of an empty tree): the bonus token
            return VerifyResult(path, [tokens[n - 1] for n in path],
                                _sample(target_probs[node], generator), is_bonus=True)
        probs = target_probs[node].clone()
        accepted = None
        for child in kids:
            token = tokens[child - 1]
            mass = float(probs.sum())
            if mass > 0 and _uniform(generator, probs.device) < float(probs[token]) / mass:
                accepted = child
                break
            probs[token] = 0.0  # rejected: the residual is p without this token, renormalised
        if accepted is None:
            if float(probs.sum()) <= 0:  # every bit of mass was on rejected tokens: impossible
                probs = target_probs[node]  # unless p had zeros where rounding put mass; be safe
            return VerifyResult(path, [tokens[n - 1] for n in path], _sample(probs, generator),
                                is_bonus=False)
        path.append(accepted)
        node = accepted


def _accept_chain_with_q(tree: DraftTree, target_probs: Tensor, generator: torch.Generator | None
                         ) -> VerifyResult:
    tokens = tree.tokens.tolist()
    q_all = tree.draft_probs
    path: list[int] = []
    for index, token in enumerate(tokens):
        p, q = target_probs[index], q_all[index].to(target_probs.dtype)
        if q.shape[0] != p.shape[0]:  # draft vocabulary narrower or wider than the target's
            q = torch.nn.functional.pad(q, (0, max(p.shape[0] - q.shape[0], 0)))[: p.shape[0]]
        ratio = float(p[token]) / max(float(q[token]), 1e-20)
        if _uniform(generator, p.device) < min(1.0, ratio):
            path.append(index + 1)
            continue
        residual = (p - q).clamp(min=0)
        if float(residual.sum()) <= 0:
            residual = p
        return VerifyResult(path, tokens[: len(path)], _sample(residual, generator), is_bonus=False)
    bonus = _sample(target_probs[len(tokens)], generator)
    return VerifyResult(path, tokens, bonus, is_bonus=True)
