"""The small dataclasses handed between draft -> verify -> accept steps.

Vocabulary (as in vLLM's spec_decode): *accepted* tokens are draft tokens the target agreed
with; the *recovered* token replaces the first rejected draft (sampled from the residual
distribution); the *bonus* token follows when every draft on the path was accepted. Each
verification step therefore emits accepted + 1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class DraftTree:
    """Draft tokens as a tree under the root (the last emitted token, not yet in the KV cache).

    Nodes are numbered 1..N in the order given; node 0 is the root. Parents come before
    children. A chain is the tree where parents[i] = i - 1.
    """

    tokens: Tensor  # [N] long: draft token of each node
    parents: Tensor  # [N] long: parent node of each node (0 = the root)
    draft_probs: Tensor | None = None  # [N, V] draft distribution each token was sampled from;
    # None means the drafts are deterministic (argmax, n-gram): point masses for acceptance.

    def __post_init__(self) -> None:
        assert self.tokens.shape == self.parents.shape and self.tokens.dim() == 1
        # in Python: a tree is a few nodes, and every drafting step builds one
        assert all(parent < node for node, parent in enumerate(self.parents.tolist(), start=1)), \
            "parents must come before children"
        if self.draft_probs is not None:
            assert self.is_chain, "sampled drafts with probabilities are supported as a chain"

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @property
    def is_chain(self) -> bool:
        return bool(torch.equal(self.parents, torch.arange(self.size)))

    @classmethod
    def chain(cls, tokens: list[int], draft_probs: Tensor | None = None) -> DraftTree:
        return cls(torch.tensor(tokens, dtype=torch.long), torch.arange(len(tokens)), draft_probs)

    @classmethod
    def empty(cls) -> DraftTree:
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    def truncated(self, max_nodes: int) -> DraftTree:
        """The first `max_nodes` nodes (parents come first, so this stays a tree)."""
        if self.size <= max_nodes:
            return self
        probs = self.draft_probs[:max_nodes] if self.draft_probs is not None else None
        return DraftTree(self.tokens[:max_nodes], self.parents[:max_nodes], probs)


@dataclass
class VerifyResult:
    accepted_nodes: list[int]  # node ids along the accepted path (root excluded), in order
    accepted_tokens: list[int]  # their draft tokens
    next_token: int  # recovered (after a rejection) or bonus (all accepted) token
    is_bonus: bool  # True when every draft on the path was accepted and a child was due

    @property
    def emitted(self) -> list[int]:
        return self.accepted_tokens + [self.next_token]


@dataclass
class SpecMetrics:
    """Per-request speculative statistics. tau = 1 + accepted / steps (the bonus counts)."""

    steps: int = 0  # verification passes
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)  # by depth 1, 2, ...
    drafted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0  # its proposer's own drafting, on speculative steps
    verify_seconds: float = 0.0  # the passes of its speculative steps (a batch's whole pass)
    plain_steps: int = 0  # steps decoded without speculation (fallback)
    plain_seconds: float = 0.0  # its plain steps, whole
    fallbacks: int = 0  # times speculation was switched off because it did not pay

    def record(self, tree: DraftTree, depths: list[int], result: VerifyResult) -> None:
        self.steps += 1
        self.drafted += tree.size
        self.accepted += len(result.accepted_tokens)
        deepest = max(depths, default=0)
        for store in (self.accepted_per_position, self.drafted_per_position):
            store.extend([0] * (deepest - len(store)))
        for depth in set(depths):
            self.drafted_per_position[depth - 1] += 1
        for depth in range(1, len(result.accepted_tokens) + 1):
            self.accepted_per_position[depth - 1] += 1

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {
            "verification_steps": self.steps,
            "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_length": round(self.acceptance_length, 4),
            "acceptance_rate_per_position": [round(r, 4) for r in self.acceptance_rate_per_position()],
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "plain_steps": self.plain_steps,
            "plain_seconds": round(self.plain_seconds, 4),
            "fallbacks": self.fallbacks,
        }
