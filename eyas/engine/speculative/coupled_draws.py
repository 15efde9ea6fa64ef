"""Drafts that draw with the target's own noise: sampled acceptance close to greedy's.

A plain-temperature request draws its token at output position k as argmax_j (l_j / T +
g^(k)_j), g^(k) the Gumbel noise of that position (engine/gumbel.py). The noise is fixed by the
request's noise base and k before any logit exists, so a draft can use it too: ranking its
candidates for position k by l'_j / T + g^(k)_j (l' its own logits), it proposes the token the
target will draw wherever its logits order the tokens as the target's do under that noise.
A draft equal to the target would be accepted at every position; a draft of the tokens most
probable under its own distribution is accepted with probability p(token), 0.2 at temperature
1 for the shipped SmolLM2 head.

Only the draft changes. The target draws at every node with the same noise as plain decoding
(acceptance.accept_drawn), so the output is the one plain decoding gives, token for token with
a seed, whatever the draft proposes.

Which drafts: the EAGLE-3 head's tree (proposers/eagle3.py: its candidates at each depth
ranked by the perturbed logits, sharpened by a factor learned from the target's draws
(Sharpness), scored by their log-softmax), Medusa heads (proposers/medusa.py: head k's with the
noise of the position k + 1 ahead) and a draft model's chain (proposers/draft_model.py: each
token drawn through the draft's own output screen with the position's noise, a deterministic
chain instead of a sampled one with its probabilities).
Only requests whose tokens are Gumbel draws (gumbel.draws_by_screen: temperature > 0, no top-k,
top-p, processors or logprobs) have a noise base; the others draft as before.

Usage:
    coupling = CoupledDraws(inverse_temperature(0.7), request.noise_base, request.prompt_len)
    proposer.draw_with(coupling)                             # after proposer.begin(...)
    position = coupling.position(len(token_ids), depth=1)    # the output position a depth-1 draft fills
    scores = coupling.scores(logits, target_ids, position)   # [F, N]: l' / T + g at the draft's ids
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import Tensor

from eyas.engine.gumbel import noise_key


def enabled() -> bool:
    """Whether drafts draw with the target's noise: unless EYAS_COUPLED_DRAFTS is 0 (which
    drafts from the draft's own distribution as before, for comparisons)."""
    return os.environ.get("EYAS_COUPLED_DRAFTS", "1") != "0"


KEPT_POSITIONS = 32  # noise rows kept for reuse: a step's depths, and the next steps' overlap
SHARPNESS_CHOICES = (1.0, 1.25, 1.5, 2.0, 3.0)  # factors on a draft's logits, scored side by side


@dataclass
class CoupledDraws:
    inverse_temperature: float  # 1 / T as the target multiplies its logits (gumbel.inverse_temperature)
    noise_base: int  # the request's (Request.noise_base)
    prompt_len: int  # output position k is token index prompt_len + k of the request's token ids
    _noise: dict[int, Tensor] = field(default_factory=dict, repr=False)  # position -> noise [N]
    _ids: Tensor | None = field(default=None, repr=False)  # the ids the kept rows are at

    def __post_init__(self) -> None:
        if not self.inverse_temperature > 0:
            raise ValueError(f"inverse_temperature must be > 0, got {self.inverse_temperature}")
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len}")

    def position(self, context_length: int, depth: int) -> int:
        """The output position a draft at `depth` (1: the root's child) fills, for a context of
        `context_length` tokens (prompt and output so far, the root last)."""
        return context_length - self.prompt_len + depth - 1

    def key(self, position: int) -> int:
        """The noise key of output position `position` (what the target draws it with)."""
        return noise_key(self.noise_base, position)

    def noise(self, position: int, ids: Tensor) -> Tensor:
        """The target's noise of output position `position` at the token ids `ids` [N] ->
        [N] float32. Kept per position: successive steps ask for overlapping positions."""
        if self._ids is not ids:  # kept rows hold the noise at other ids
            self._noise, self._ids = {}, ids
        row = self._noise.get(position)
        if row is None:
            keys = torch.tensor([self.key(position)], dtype=torch.int64)
            row = torch.ops.eyas.gumbel_noise_at(keys, ids)[0]
            if len(self._noise) >= KEPT_POSITIONS:
                del self._noise[min(self._noise)]
            self._noise[position] = row
        return row

    def scores(self, logits: Tensor, ids: Tensor, position: int, sharpness: float = 1.0) -> Tensor:
        """Draft logits [..., N] over the token ids `ids` [N] -> l * sharpness / T + g, float32
        [..., N]: the values the target's draw at `position` compares, with the draft's logits
        (sharpened where the draft is flatter than the target: proposers/eagle3.py)."""
        scale = self.inverse_temperature * sharpness
        return logits.float() * scale + self.noise(position, ids).to(logits.device)


class Sharpness:
    """The factor on a draft's logits (`CoupledDraws.scores`) under which its first candidate is
    the target's draw most often, learned from the target's draws: at every position whose
    drawn token becomes known, each of SHARPNESS_CHOICES is scored on the same logits and noise,
    and the best so far is used (`prior` until one beats it). A head flatter than its target
    wants more than 1; one that matches it, 1. A proposer's copies (one per served request)
    share one, so serving learns from every request."""

    def __init__(self, prior: float) -> None:
        if prior not in SHARPNESS_CHOICES:
            raise ValueError(f"prior must be one of {SHARPNESS_CHOICES}, got {prior}")
        self.prior = prior
        self.hits = [0] * len(SHARPNESS_CHOICES)
        self.seen = 0

    @property
    def value(self) -> float:
        best = max(self.hits)
        if self.hits[SHARPNESS_CHOICES.index(self.prior)] == best:
            return self.prior
        return SHARPNESS_CHOICES[self.hits.index(best)]

    def learn(self, coupling: CoupledDraws, logits: Tensor, ids: Tensor, positions: list[int],
              tokens: list[int]) -> None:
        """logits [R, N]: the draft's for output positions `positions` [R], whose draws were
        `tokens` [R] (target ids; ids [N] maps the draft's ids to target ids)."""
        noise = torch.stack([coupling.noise(position, ids) for position in positions]).to(logits.device)  # [R, N]
        scales = torch.tensor([coupling.inverse_temperature * factor for factor in SHARPNESS_CHOICES])  # [C]
        values = logits.float()[None] * scales[:, None, None].to(logits.device) + noise[None]  # [C, R, N], as scores()
        picked = ids[values.argmax(-1).cpu()]  # [C, R] target ids
        found = (picked == torch.tensor(tokens)[None]).sum(-1).tolist()  # [C]
        self.hits = [hits + count for hits, count in zip(self.hits, found)]
        self.seen += len(tokens)

    def stats(self) -> dict:
        return {"sharpness": self.value, "sharpness_observed": self.seen,
                "sharpness_hits": dict(zip(map(str, SHARPNESS_CHOICES), self.hits))}
