"""The proposer interface every drafting method implements.

Per request: `begin` once, then per step `propose` (drafts under the current root) and
`observe` (what the verifier accepted, with the target's forward output for methods that read
the target's hidden states, such as EAGLE-3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from eyas.engine.sampling import SamplingParams
    from eyas.engine.speculative.draft import DraftTree, VerifyResult
    from eyas.engine.target import Target
    from eyas.models.llama import ForwardOutput


class Proposer(Protocol):
    name: str
    tap_layers: tuple[int, ...]  # target layers whose input the proposer reads (EAGLE-3)

    def begin(self, target: Target, prompt_ids: list[int], params: SamplingParams) -> None:
        """Start a request whose prompt is `prompt_ids`."""

    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        """Drafts that follow `token_ids` (prompt + output; the last one is the root)."""

    def observe(self, tree: DraftTree, result: VerifyResult, output: ForwardOutput | None) -> None:
        """What the last verification accepted (output is None after a plain step)."""
