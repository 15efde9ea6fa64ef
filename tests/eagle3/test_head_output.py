"""The draft head's output step in C++ (models/csrc/head_output.cpp) against the PyTorch ops it
replaces, bit for bit: the final RMSNorm as F.rms_norm computes it (widths, scales, rows), the
norm and int4 output layer of the shipped SmolLM2 head as `head.compute_logits` computes them
(on the head's real hidden states), and the top-k of a log-softmax as torch.topk returns it,
ties and NaNs included."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from eyas.models import extension

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build the extension")


@pytest.fixture(scope="module")
def ext():
    module = extension.module()
    if module is None:
        pytest.skip("the extension is not built here")
    return module


@pytest.mark.parametrize("width", [1, 7, 8, 9, 31, 64, 100, 576, 577, 960, 2048, 4100, 32767, 32768, 100000])
def test_the_norm_is_torchs_rms_norm_bit_for_bit(ext, width):
    generator = torch.Generator().manual_seed(width)
    rows = 1 if width > 20000 else 40
    x = torch.randn(rows, width, generator=generator) * torch.logspace(-3, 3, rows)[:, None]
    weight = torch.randn(width, generator=generator)
    for eps in (1e-5, 1e-6):
        assert torch.equal(ext.torch_rms_norm(x, weight, eps), F.rms_norm(x, (width,), weight, eps))
    assert torch.equal(ext.torch_rms_norm(x[:1], weight, 1e-5), F.rms_norm(x[:1], (width,), weight, 1e-5))


@torch.inference_mode()
def test_the_fused_output_layer_is_compute_logits_bit_for_bit(ext, smollm_int4_target, mtbench_prompt_ids):
    """On the shipped head's own outputs over a prompt (and scaled copies), one row at a time as
    drafting calls it and all rows at once: fused.logits == head.compute_logits."""
    from eyas.engine.speculative.methods import build_proposer

    proposer = build_proposer("eagle3:smollm2-135m", smollm_int4_target, tree="chain:1")
    head, fused = proposer.head, proposer.fused
    if fused is None:
        pytest.skip("no fused head here (no int8dot kernel: EYAS_FUSED=0 or a CPU without AVX2)")
    assert fused.norm_in_cpp  # x86 with PyTorch's float sum order: the C++ norm is in use
    ids = torch.tensor([mtbench_prompt_ids[1]])
    taps = smollm_int4_target.model(ids, logits_at=None, tap_layers=proposer.tap_layers).taps
    count = ids.shape[1] - 1
    hidden = fused.run(taps[0, :count], ids[0, 1:], torch.arange(count), 0, fused.new_cache())  # [count, H]
    rows = torch.cat([hidden, hidden[:8] * 1e-3, hidden[:8] * 50.0])
    expected = head.compute_logits(rows[None])[0]
    assert torch.equal(fused.logits(rows), expected)
    for row in range(0, rows.shape[0], 7):
        assert torch.equal(fused.logits(rows[row : row + 1]), expected[row : row + 1])


def reference_top_k(scores: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    top = torch.topk(torch.log_softmax(scores, dim=-1), k, dim=-1)
    return top.values.tolist(), top.indices.tolist()


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_top_k_of_the_log_softmax_is_torchs(ext, k):
    generator = torch.Generator().manual_seed(k)
    for rows, width in [(1, 8192), (3, 8192), (4, 100), (2, 7)]:
        scores = torch.randn(rows, width, generator=generator) * 4
        assert ext.log_softmax_top_k(scores, k) == reference_top_k(scores, k)
        assert ext.log_softmax_top_k(scores[:, :k], k) == reference_top_k(scores[:, :k], k)  # k == N
    # ties (left to torch.topk's own choice): the best value twice, the k-th value twice, a row of
    # equal values; NaN (ranked first by torch.topk); -inf
    scores = torch.randn(6, 8192, generator=generator)
    best = scores[0].argmax()
    scores[0, 17] = scores[0, best]
    kth = scores[1].topk(k).indices[-1]
    scores[1, 4000] = scores[1, kth]
    scores[2] = 1.5
    scores[3, 123] = float("nan")
    scores[4, :8000] = float("-inf")
    scores[5, 5] = float("inf")
    for row in range(scores.shape[0]):
        expected = reference_top_k(scores[row : row + 1], k)
        actual = ext.log_softmax_top_k(scores[row : row + 1], k)
        assert str(actual) == str(expected)  # NaN-aware equality
    assert str(ext.log_softmax_top_k(scores, k)) == str(reference_top_k(scores, k))


def test_the_top_k_refuses_what_torch_would(ext):
    with pytest.raises(RuntimeError, match="k must lie in 1..N"):
        ext.log_softmax_top_k(torch.randn(1, 4), 5)
    with pytest.raises(RuntimeError, match="float32"):
        ext.log_softmax_top_k(torch.randn(1, 4, dtype=torch.float64), 1)
