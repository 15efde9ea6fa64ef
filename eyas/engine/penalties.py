"""Sampling penalties and `logit_bias` as logits processors, with vLLM's semantics.

Order at every position (vLLM's sampler): logit_bias, then the repetition penalty, then the
frequency and presence penalties; temperature, top-k and top-p come after (sampling.py).

- `logit_bias` {token id: bias}: the bias is added to that token's logit (-100 bans it in
  practice, +100 forces it).
- `repetition_penalty` r (> 0, 1 = off), over the prompt and the completion so far (as vLLM
  applies it): a token seen there has its logit divided by r when positive, multiplied by r
  otherwise.
- `frequency_penalty` f and `presence_penalty` p (-2..2, OpenAI's definition), over the
  completion so far: logit -= f * count(token) + p * (count(token) > 0).

Each is a `LogitsProcessor` (engine/logits_process.py): a fixed function of the completion so
far, so that a draft-tree node is penalised exactly as plain decoding would penalise the same
position, and speculation stays lossless.

Usage:
    from eyas.engine.penalties import sampling_processors
    processors = sampling_processors(params, prompt_ids)   # [] when params ask for none
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor

from eyas.engine.logits_process import LogitsProcessor
from eyas.engine.sampling import SamplingParams


class LogitBias:
    """Adds a fixed bias to chosen tokens' logits."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(sorted(bias), dtype=torch.long)  # [K]
        self.values = torch.tensor([float(bias[i]) for i in sorted(bias)])  # [K]

    def __call__(self, output_ids: Sequence[int], logits: Tensor) -> Tensor:
        logits[self.ids] += self.values.to(logits.dtype)
        return logits


class Penalties:
    """Repetition (prompt + completion), frequency and presence (completion) penalties."""

    def __init__(self, prompt_ids: Iterable[int], presence: float = 0.0, frequency: float = 0.0,
                 repetition: float = 1.0) -> None:
        if repetition <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition}")
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.prompt_ids = torch.tensor(sorted(set(prompt_ids)), dtype=torch.long)  # [P] unique

    def __call__(self, output_ids: Sequence[int], logits: Tensor) -> Tensor:
        ids = torch.tensor(list(output_ids), dtype=torch.long)
        seen, counts = ids.unique(return_counts=True)  # [U] each: the completion's tokens
        if self.repetition != 1.0:
            both = torch.cat([self.prompt_ids, seen]).unique()
            values = logits[both]
            logits[both] = torch.where(values > 0, values / self.repetition, values * self.repetition)
        if self.frequency:
            logits[seen] -= self.frequency * counts.to(logits.dtype)
        if self.presence:
            logits[seen] -= self.presence
        return logits


def sampling_processors(params: SamplingParams, prompt_ids: Sequence[int]) -> list[LogitsProcessor]:
    """The processors `params` ask for, in vLLM's order (logit_bias, then the penalties)."""
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        processors.append(LogitBias(params.logit_bias))
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        processors.append(Penalties(prompt_ids, params.presence_penalty, params.frequency_penalty,
                                    params.repetition_penalty))
    return processors
