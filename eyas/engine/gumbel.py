"""Sampling by the Gumbel-max trick, through the output layer's screen: exact, at greedy's cost.

A sample from softmax(l / T) is argmax_j (l_j / T + g_j) with g_j i.i.d. Gumbel(0, 1). The
output layer's int8 screen bounds every logit (models/output_layer.py); only the tokens whose
upper value can reach the best lower value are computed exactly (csrc/gumbel_screen.cpp), so a
sampled row reads the int8 copy of the output layer instead of the float32 one, and no softmax
over the vocabulary is taken. The token is exactly the argmax of fl(fl(l_j * (1/T)) + g_j) over
the float32 logits: a sample of the float distribution.

Which rows: temperature > 0 with top_k = 0, top_p = 1 and no logits processors (penalties,
logit_bias, grammars) or logprobs (`draws_by_screen`); drafts with draft probabilities (a
sampled draft model's chain) keep the p/q rule over full probabilities
(engine/speculative/acceptance.py). Everything else samples from `target_probs` as before.

Noise per position: the noise of the token at output position k (0 = the first generated
token) is a function of the request's noise base and k (`noise_key`), the base drawn once from
the request's generator (seeded requests: from their seed). Plain decoding draws token k with
that noise; speculative verification draws at each visited node with the noise of the
position that node's token would fill, accepts the child whose token equals the draw and
otherwise emits the draw (acceptance.accept_drawn). Both emit argmax(l / T + g^(k)) at every
position, so a seeded request gives the same tokens with or without speculation wherever the
target's logits at a position agree (as greedy output does), and the rule is exact: the
total acceptance of a node's children is the sum of their probabilities, as with
accept_sampling's sequential rule.

Usage:
    keys = torch.tensor([noise_key(request.noise_base, position)])
    tokens = sample_rows(model.lm_head, hidden, torch.tensor([inverse_temperature(0.7)]), keys)
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
from torch import Tensor

from eyas.engine.sampling import SamplingParams, argmax_rows

GOLDEN = 0x9E3779B97F4A7C15  # the Weyl increment of SplitMix64
MASK = (1 << 64) - 1


@functools.cache
def available() -> bool:
    """Whether sampled rows draw through the screen: the extension's noise
    (csrc/gumbel_screen.cpp) can be computed here, and EYAS_SAMPLING_SCREEN is not 0 (0 keeps
    every sampled row on the full product and inverse-CDF sampling, for comparisons)."""
    from eyas.models import extension

    if os.environ.get("EYAS_SAMPLING_SCREEN", "1") == "0":
        return False
    return extension.module() is not None and hasattr(torch.ops.eyas, "gumbel_noise")


def draws_by_screen(params: SamplingParams, needs_full_logits: bool) -> bool:
    """Whether a request's sampled tokens are Gumbel draws (plain temperature, nothing that
    reads or changes the logits)."""
    return (params.temperature > 0 and params.top_k == 0 and params.top_p == 1.0
            and not needs_full_logits and available())


def new_noise_base(generator: torch.Generator | None) -> int:
    """A request's noise base, from its generator (the global RNG when None)."""
    return int(torch.randint(0, 2**62, (), generator=generator))


def noise_key(base: int, position: int) -> int:
    """The 64-bit key of output position `position`'s noise, as a signed int64."""
    key = (base + position * GOLDEN) & MASK
    return key - (1 << 64) if key >= 1 << 63 else key


def inverse_temperature(temperature: float) -> float:
    """1 / T rounded to float32: the factor each logit is multiplied by."""
    return float(np.float32(1.0 / temperature))


def gumbel_noise(keys: Tensor, vocab: int) -> Tensor:
    """keys [R] int64 -> the Gumbel(0, 1) noise [R, V] float32 of each key."""
    return torch.ops.eyas.gumbel_noise(keys, vocab)


def gumbel_argmax(logits: Tensor, inverse_temperatures: Tensor, keys: Tensor,
                  noise_ids: Tensor | None = None) -> Tensor:
    """The draws from full logits [R, V] float32 -> [R]: argmax(l * (1/T) + g), the same values
    the screen compares (where the float32 logits agree to the last bit). noise_ids [V] int64:
    column j takes the noise of token id noise_ids[j] (a subset of a vocabulary)."""
    logits = logits.float()
    noise = (gumbel_noise(keys, logits.shape[-1]) if noise_ids is None
             else torch.ops.eyas.gumbel_noise_at(keys, noise_ids))  # [R, V]
    return argmax_rows(logits * inverse_temperatures.float()[:, None] + noise)


def sample_rows(lm_head, hidden: Tensor, inverse_temperatures: Tensor, keys: Tensor) -> Tensor:
    """One draw per row of hidden [R, H] -> [R] int64: through the screen where the output
    layer has one (ScreenedOutputLayer.sample_tokens), else from its full float32 logits."""
    if hasattr(lm_head, "sample_tokens"):
        return lm_head.sample_tokens(hidden, inverse_temperatures, keys)
    return gumbel_argmax(lm_head(hidden), inverse_temperatures, keys)
