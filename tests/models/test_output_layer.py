"""The screened output layer: its argmax is the float32 argmax, whatever rows share the pass."""

import contextlib
import os
from unittest import mock

import pytest
import torch
from torch import nn

from eyas.models import extension
from eyas.models.cpu_linear import TransposedLinear
from eyas.models.output_layer import ScreenedOutputLayer


def layer_with(weight: torch.Tensor) -> ScreenedOutputLayer:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    return ScreenedOutputLayer(TransposedLinear(linear))


def test_the_argmax_is_exact_on_near_ties_and_exact_ties():
    torch.manual_seed(0)
    weight = torch.randn(4096, 64) * 0.1
    weight[100] = weight[7]  # an exact tie: the first index wins, as in torch.argmax
    weight[2000] = weight[1000] * (1 + 1e-6)  # a near-tie far below int8 resolution
    layer = layer_with(weight)
    x = torch.stack([weight[7] * 50, weight[1000] * 50, *torch.randn(30, 64)])  # [32, 64]
    exact = x @ weight.t()
    screened = layer.greedy_logits(x)
    assert torch.equal(screened.argmax(-1), exact.argmax(-1))
    assert screened.argmax(-1)[0] == 7
    assert screened.argmax(-1)[1] == exact[1].argmax()  # 1000 or 2000, as float32 decides
    assert layer.greedy_tokens(x) == exact.argmax(-1).tolist()  # no logits out, the same argmax
    assert torch.equal(layer(x), x @ layer.weight_t)  # the plain path is the float32 product


def test_a_row_gets_the_same_values_alone_or_in_a_batch():
    torch.manual_seed(1)
    layer = layer_with(torch.randn(2048, 64) * 0.1)
    x = torch.randn(2, 5, 64)
    together = layer.greedy_logits(x)  # [2, 5, V]
    alone = torch.stack([layer.greedy_logits(row[None])[0] for row in x.reshape(10, 64)])
    assert together.shape == (2, 5, 2048)
    assert torch.equal(together.reshape(10, 2048), alone)


@contextlib.contextmanager
def screen_bits(layer: ScreenedOutputLayer, bits: int | None):
    """The extension's screen with `bits`-bit activations (8 or 14) for the block; None: as is."""
    if bits is None:
        yield
        return
    if not layer.int8dot:
        pytest.skip("no int8 dot-product kernel here: only PyTorch's screen")
    ext = extension.module()
    before = ext.screen_activation_bits()
    ext.set_screen_activation_bits(bits)
    try:
        yield
    finally:
        ext.set_screen_activation_bits(before)


@pytest.mark.parametrize("bits", [8, 14])
def test_the_bound_holds_and_the_argmax_is_the_float64_one_on_random_logits(bits):
    """Random weights (Gaussian, and heavy-tailed rows as trained models have) and inputs with
    outliers: every exact logit lies in its interval and the screened argmax is the float64 one."""
    torch.manual_seed(5)
    weight = torch.randn(8192, 128) * 0.05
    weight[::7] *= torch.rand(1171, 1) * 4  # rows of different norms
    layer = layer_with(weight)
    x = torch.randn(40, 128)
    x[::5, 3] *= 30.0  # outlier inputs: the rest of the row gets few levels
    x[1] = weight[17] * 20  # one clear winner
    exact = x.double() @ weight.double().t()  # [R, V] float64
    with screen_bits(layer, bits), torch.inference_mode():
        approx, bound = layer.screen(x)
        screened = layer.greedy_logits(x)
        tokens = layer.greedy_tokens(x.reshape(8, 5, 128))  # any leading dimensions
    assert bool(((exact - approx.double()).abs() <= bound.double()).all())
    assert torch.equal(screened.argmax(-1), exact.argmax(-1))
    assert screened.argmax(-1)[1] == 17
    assert tokens == exact.argmax(-1).tolist()


@pytest.mark.parametrize("screen", ["model's 8-bit", "model's 14-bit", "pytorch"])
def test_the_error_bound_holds_on_smollm2_hidden_states(smollm_int4_target, mtbench_prompt_ids, screen):
    """Both screens: the extension's (the model's, where it has an int8dot kernel; 8- and 14-bit
    activations) and PyTorch's int8 kernel with the bound in output_layer.py
    (EYAS_INT4_KERNEL=torch)."""
    model = smollm_int4_target.model
    layer = model.lm_head
    assert isinstance(layer, ScreenedOutputLayer)  # what the engine decodes with on a CPU
    # SmolLM2 ties its embedding to the output layer: the row-major weight is not copied
    assert layer.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    if screen == "pytorch":
        with mock.patch.dict(os.environ, {"EYAS_INT4_KERNEL": "torch"}):
            layer = ScreenedOutputLayer(TransposedLinear(nn.Linear(576, 49152, bias=False)), rows=layer.weight)
        assert not layer.int8dot
    ids = torch.tensor([sum(mtbench_prompt_ids[:3], [])])
    bits = {"model's 8-bit": 8, "model's 14-bit": 14}.get(screen)
    with screen_bits(layer, bits), torch.inference_mode():
        hidden = model(ids, logits_at=None).hidden[0]  # [T, H]
        exact = hidden @ layer.weight.t()
        approx, bound = layer.screen(hidden)
        screened = layer.greedy_logits(hidden)
        tokens = layer.greedy_tokens(hidden)
        candidates = (approx + bound >= (approx - bound).amax(1, keepdim=True)).sum(1)  # [T]
    assert bool(((exact - approx).abs() <= bound).all())
    assert torch.equal(screened.argmax(-1), exact.argmax(-1))
    assert tokens == exact.argmax(-1).tolist()
    assert candidates.float().median() <= 64  # of 49,152: the screen is worth its cost
    best = exact.argmax(-1, keepdim=True)
    # the maximum is its float32 dot product (a matmul may round its last bit otherwise)
    assert torch.allclose(screened.gather(1, best), exact.gather(1, best), rtol=1e-6, atol=0)


def test_greedy_tokens_of_rows_that_are_not_finite_are_greedy_logits_argmax():
    """A row with NaN or infinite inputs has no bound to trust: its token is still what
    argmax(greedy_logits(row)) gives (NaN counting as the largest), the other rows unaffected."""
    torch.manual_seed(3)
    weight = torch.randn(2048, 64) * 0.1
    layer = layer_with(weight)
    x = torch.randn(4, 64)
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    x[3, 0] = -float("inf")
    with torch.inference_mode():
        expected = layer.greedy_logits(x).argmax(-1).tolist()
        tokens = layer.greedy_tokens(x)
    assert tokens == expected
    assert tokens[0] == (x[0] @ weight.t()).argmax().item()


def test_rows_that_are_not_the_layers_weight_are_refused():
    layer = nn.Linear(64, 128, bias=False)
    with pytest.raises(ValueError, match="do not match"):
        ScreenedOutputLayer(TransposedLinear(layer), rows=torch.zeros(64, 128))


def test_the_extensions_recheck_matches_the_python_one():
    """Where the extension screens, candidates are re-checked inside the same C++ call: the same
    candidates as the Python re-check on the same screen, each exact, the rest untouched."""
    torch.manual_seed(2)
    weight = torch.randn(4096, 64) * 0.1
    weight[3000] = weight[11] * (1 + 1e-6)  # a near-tie
    layer = layer_with(weight)
    if not layer.int8dot:
        pytest.skip("no int8 dot-product kernel here: the Python re-check is the only one")
    x = torch.cat([weight[11:12] * 40, torch.randn(12, 64)])  # [13, 64]
    approx, bound = layer.screen(x)
    candidates = approx + bound >= (approx - bound).amax(1, keepdim=True)  # [13, V]
    screened = layer.greedy_logits(x)
    exact = x @ weight.t()
    assert torch.equal(screened[~candidates], approx[~candidates])
    assert torch.allclose(screened[candidates], exact[candidates], rtol=1e-6, atol=1e-7)
    assert torch.equal(screened.argmax(-1), exact.argmax(-1))
    assert int(candidates.sum()) >= 13 + 1  # the near-tie's row holds both rows 11 and 3000
