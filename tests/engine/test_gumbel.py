"""Sampling through the output layer's screen (engine/gumbel.py, csrc/gumbel_screen.cpp): the
noise is Gumbel(0, 1), the screened draw is the argmax over every float32 logit with the same
noise, draws follow softmax(l / T), and a wrong temperature is caught by the same check."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eyas.engine import gumbel
from eyas.engine.gumbel import gumbel_argmax, gumbel_noise, inverse_temperature, noise_key
from eyas.engine.sampling import SamplingParams
from eyas.models.output_layer import ScreenedOutputLayer

pytestmark = pytest.mark.skipif(not gumbel.available(), reason="the C++ extension is not built here")

P_VALUE = 1e-3
VOCAB, HIDDEN = 256, 64


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts under probs (categories with expected count >= 5 kept, the
    rest pooled into one)."""
    expected = probs.double() * counts.sum()
    keep = expected >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    used = expected > 0
    statistic = (((observed - expected) ** 2) / expected)[used].sum()
    dof = int(used.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2.0))


@pytest.fixture(scope="module")
def layer() -> ScreenedOutputLayer:
    torch.manual_seed(0)
    linear = nn.Linear(HIDDEN, VOCAB, bias=False)
    nn.init.normal_(linear.weight, std=0.4)  # logits spread over a few units: a peaked softmax
    return ScreenedOutputLayer(linear)


def exact_logits(layer: ScreenedOutputLayer, x: torch.Tensor) -> torch.Tensor:
    """x [R, H] -> the float32 logits [R, V], each from float64 products rounded once."""
    return (x.double() @ layer.weight.double().t()).float()


def keys_for(count: int, base: int = 12345) -> torch.Tensor:
    return torch.tensor([noise_key(base, position) for position in range(count)])


def test_noise_is_gumbel_and_a_function_of_its_key():
    keys = keys_for(64)
    noise = gumbel_noise(keys, 4096).double()  # [64, 4096]
    assert torch.equal(gumbel_noise(keys[3:4], 4096), noise[3:4].float())  # a row alone: the same
    assert not torch.equal(noise[0], noise[1])
    euler = 0.5772156649
    assert abs(float(noise.mean()) - euler) < 0.01
    assert abs(float(noise.var()) - math.pi ** 2 / 6) < 0.03
    # Kolmogorov-Smirnov against exp(-exp(-x)) on 262,144 values: D < 0.004 (p ~ 1e-3 at 0.0038)
    values = noise.flatten().sort().values
    cdf = torch.exp(-torch.exp(-values))
    n = values.numel()
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    distance = torch.maximum(ranks / n - cdf, cdf - (ranks - 1) / n).max()
    assert float(distance) < 0.004
    assert float(values[-1]) < 23.0 and float(values[0]) > -3.0


@pytest.mark.parametrize("temperature", [0.2, 0.7, 1.0, 1.7])
def test_the_screened_draw_is_the_argmax_over_every_logit_with_the_same_noise(layer, temperature):
    torch.manual_seed(1)
    x = torch.randn(400, HIDDEN)  # 400 rows, each with its own noise
    keys = keys_for(400, base=int(temperature * 1000))
    scale = torch.full((400,), inverse_temperature(temperature))
    drawn = layer.sample_tokens(x, scale, keys)
    reference = gumbel_argmax(exact_logits(layer, x), scale, keys)
    assert torch.equal(drawn, reference)
    assert len(set(drawn.tolist())) > 20  # draws, not one argmax
    # the single-stream form: Python numbers in, ints out, any leading dimensions
    ids = layer.sample_token_ids(x.reshape(20, 20, HIDDEN), scale.tolist(), keys.tolist())
    assert ids == drawn.tolist()


def test_candidates_are_few(layer):
    """The screen re-checks only the tokens that can win, not the vocabulary."""
    x = torch.randn(64, HIDDEN)
    scale = torch.full((64,), inverse_temperature(0.7))
    _, candidates = torch.ops.eyas.int8_screen_gumbel(x, layer.packed, layer.scale_float, layer.code_sums,
                                                      layer.weight_error, layer.approx_norm, layer.weight,
                                                      scale, keys_for(64))
    assert float(candidates.float().mean()) < VOCAB / 8 and int(candidates.min()) >= 1


def draw_counts(layer, x, temperature: float, draws: int) -> torch.Tensor:
    rows = x.expand(draws, -1)
    keys = keys_for(draws, base=7)
    scale = torch.full((draws,), inverse_temperature(temperature))
    tokens = layer.sample_tokens(rows, scale, keys)
    return torch.bincount(tokens, minlength=VOCAB).double()


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_draws_follow_the_softmax(layer, temperature):
    torch.manual_seed(2)
    x = torch.randn(1, HIDDEN)
    counts = draw_counts(layer, x, temperature, 40000)
    probs = torch.softmax(exact_logits(layer, x)[0].double() / temperature, dim=-1)
    assert int((probs * 40000 >= 5).sum()) >= 10  # enough categories for the test to bite
    assert chi_square_p_value(counts, probs) > P_VALUE
    assert 0.5 * float((counts / counts.sum() - probs).abs().sum()) < 0.02  # total variation


def test_a_wrong_temperature_is_caught(layer):
    """Draws at temperature 1 do not pass as samples at 0.7: the check above can fail."""
    torch.manual_seed(2)
    x = torch.randn(1, HIDDEN)
    counts = draw_counts(layer, x, 1.0, 40000)
    probs = torch.softmax(exact_logits(layer, x)[0].double() / 0.7, dim=-1)
    assert chi_square_p_value(counts, probs) < 1e-6


def test_which_requests_draw_through_the_screen():
    assert gumbel.draws_by_screen(SamplingParams(temperature=0.7), needs_full_logits=False)
    assert not gumbel.draws_by_screen(SamplingParams(temperature=0.0), needs_full_logits=False)
    assert not gumbel.draws_by_screen(SamplingParams(temperature=1.0, top_k=5), needs_full_logits=False)
    assert not gumbel.draws_by_screen(SamplingParams(temperature=1.0, top_p=0.9), needs_full_logits=False)
    assert not gumbel.draws_by_screen(SamplingParams(temperature=1.0), needs_full_logits=True)


def test_noise_keys_differ_by_position_and_base():
    keys = {noise_key(base, position) for base in (0, 1, 2**61) for position in range(100)}
    assert len(keys) == 300
    assert all(-(2**63) <= key < 2**63 for key in keys)


def test_a_subset_of_rows_draws_with_the_noise_of_its_token_ids(layer):
    """noise_ids: row j of a layer draws with the noise of token id noise_ids[j] (a draft's
    subset of a vocabulary drawing as the whole would); the draw is the argmax over the rows of
    l / T + g at those ids, and the screen's candidates carry exactly that noise."""
    ids = torch.arange(VOCAB, dtype=torch.int64) * 3 + 1000  # the ids the layer's rows stand for
    x = torch.randn(200, HIDDEN, generator=torch.Generator().manual_seed(3))
    keys = keys_for(200, base=777)
    scale = torch.full((200,), inverse_temperature(0.8))
    drawn = layer.sample_tokens(x, scale, keys, noise_ids=ids)
    noise = torch.ops.eyas.gumbel_noise_at(keys, ids)  # [200, VOCAB]
    assert torch.equal(noise[:, 5], gumbel_noise(keys, 1016)[:, 1015])
    reference = (exact_logits(layer, x) * scale[:, None] + noise).argmax(dim=1)
    assert torch.equal(drawn, reference)
    assert not torch.equal(drawn, layer.sample_tokens(x, scale, keys))  # other noise, other draws
    rows, columns, candidate_noise = torch.ops.eyas.int8_screen_gumbel_candidates(
        x, layer.packed, layer.scale_float, layer.code_sums, layer.weight_error, layer.approx_norm, scale, keys, ids)
    assert torch.equal(candidate_noise, noise[rows, columns])
    assert torch.equal(torch.unique(rows), torch.arange(200))  # every row has a candidate
    assert bool((drawn[rows] == columns).sum() == 200)  # each row's draw among its candidates
    with pytest.raises(RuntimeError, match="ids must be empty or int64"):
        torch.ops.eyas.int8_screen_gumbel_candidates(x, layer.packed, layer.scale_float, layer.code_sums,
                                                     layer.weight_error, layer.approx_norm, scale, keys, ids[:9])


def test_a_plain_temperature_request_never_reads_every_logit(tiny_target, monkeypatch):
    """A plain-temperature request draws every token through the screen, its first one (from
    the prompt's last row) included: the output layer's full product never runs for it (a lean
    output layer would build its float table for that). A top-k request reads every logit."""
    from eyas.engine.generate import generate

    lm_head = tiny_target.model.lm_head
    if not hasattr(lm_head, "sample_tokens"):
        pytest.skip("this target's output layer has no screen")
    full_products = []
    forward = type(lm_head).forward
    monkeypatch.setattr(type(lm_head), "forward", lambda self, x: full_products.append(tuple(x.shape)) or forward(self, x))
    prompt = list(range(300, 312))
    sampled = generate(tiny_target, prompt, SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True))
    assert len(sampled.token_ids) == 8 and full_products == []
    again = generate(tiny_target, prompt, SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True))
    assert again.token_ids == sampled.token_ids  # seeded: the same draws
    generate(tiny_target, prompt, SamplingParams(max_tokens=2, temperature=0.9, top_k=5, seed=3, ignore_eos=True))
    assert full_products  # top-k samples from full probabilities
