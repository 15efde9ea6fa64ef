"""Sampling parameters and the target distribution they define.

The same `target_probs` feeds plain sampling and speculative verification, so that both draw
from exactly one distribution: temperature, then top-k, then top-p, then renormalisation.
temperature == 0 means greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from eyas.errors import EyasError

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes no more (a signed 64-bit integer)
MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's top_logprobs limit)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Logits processors (engine/penalties.py, vLLM's semantics), before temperature/top-k/top-p.
    presence_penalty: float = 0.0  # -2..2, over the completion
    frequency_penalty: float = 0.0  # -2..2, over the completion
    repetition_penalty: float = 1.0  # > 0 (1 = off), over the prompt and the completion
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> -100..100
    # Log-probabilities (engine/logprobs.py): of each output token with its `logprobs` most
    # likely alternatives (0 = the token alone); None = not computed. The same for the
    # prompt's tokens with `prompt_logprobs`.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise EyasError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise EyasError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EyasError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EyasError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise EyasError(f"seed must be in [0, 2^63 - 1], got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise EyasError("stop must be a list of non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise EyasError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise EyasError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0 or not -100.0 <= bias <= 100.0:
                raise EyasError(f"logit_bias maps token ids >= 0 to biases in [-100, 100]; "
                                f"got {token!r}: {bias!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise EyasError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or self.prompt_logprobs is not None

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of n (0-based): seed + index when seeded (as vLLM
        seeds its n child requests), so that the samples differ and each is reproducible."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=(self.seed + index) % (MAX_SEED + 1))

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded from `seed` (None when unseeded: the global RNG is used)."""
        if self.seed is None:
            return None
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed)
        return generator


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities [N, V] after temperature, top-k and top-p; logits [N, V] (any float)."""
    logits = logits.float() / max(params.temperature, 1e-6)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before each token
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of probs [N, V] -> [N], by inverse CDF (exact; much faster than
    torch.multinomial over a large vocabulary). A zero-probability token is never drawn."""
    cumulative = probs.double().cumsum(dim=-1)  # [N, V]
    uniform = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device,
                         dtype=torch.float64) * cumulative[:, -1:]
    index = torch.searchsorted(cumulative, uniform, right=True).squeeze(-1)
    return index.clamp(max=probs.shape[-1] - 1)


def next_tokens(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """Pick the next token per row of logits [N, V] -> [N]: argmax, or a sample."""
    if params.greedy:
        return argmax_rows(logits)
    return sample_from(target_probs(logits, params), generator)


def argmax_rows(logits: Tensor) -> Tensor:
    """logits [N, V] -> [N] int64, the first index of each row's maximum, as torch.argmax.

    On a CPU, float32, NumPy's argmax: PyTorch's took ~87 us for one row of SmolLM2's 49,152
    logits on the 2-core machine and NumPy's ~6 us, where a whole int4 decode step is ~6.7 ms.
    NaN counts as the maximum in both."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.argmax(logits.detach().numpy(), axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)
