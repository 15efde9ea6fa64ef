"""The output screen's register tiles (csrc/int8_screen_tiles.h) and its exact re-check
(csrc/int8_screen.cpp), on each implementation this CPU's build has: a row's approximate logits,
bound and greedy row have the same bits alone and in a call of any T = 2..64 (whatever tile it
lands in), both implementations give the same bits, streamed or cached stores too, and the
greedy row's argmax is the exhaustive float64 argmax."""

import contextlib
import shutil

import pytest
import torch

from eyas.models import extension

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build the extension")

IMPLEMENTATIONS = pytest.mark.parametrize("name", ["avx512vnni", "avx2"])


@contextlib.contextmanager
def kernel(name: str, bits: int = 8):
    """Runs the block on implementation `name` with `bits`-bit screen activations, then restores both."""
    if extension.int8dot_kernel() is None:
        pytest.skip("no int8 dot-product kernel here")
    ext = extension.module()
    if name not in ext.int8dot_kernels():
        pytest.skip(f"this CPU's build has no {name} kernel")
    before, before_bits = ext.int8dot_kernel(), ext.screen_activation_bits()
    ext.set_int8dot_kernel(name)
    ext.set_screen_activation_bits(bits)
    try:
        yield ext
    finally:
        ext.set_int8dot_kernel(before)
        ext.set_screen_activation_bits(before_bits)


def screen_inputs(vocab: int, hidden: int, seed: int):
    """A random output layer [V, H] and the screen's buffers for it (as models/output_layer.py builds them)."""
    torch.manual_seed(seed)
    weight = torch.randn(vocab, hidden) * 0.05
    weight[::5] *= 3.0  # rows of different norms
    scale = (weight.abs().amax(1) / 127).to(torch.bfloat16).float()
    codes = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    approx = codes.float() * scale[:, None]
    return weight, codes, (scale, codes.sum(1, dtype=torch.int32), (weight - approx).norm(dim=1), approx.norm(dim=1))


def activations(rows: int, hidden: int) -> torch.Tensor:
    x = torch.randn(rows, hidden)
    x[::3, 5] *= 40.0  # outliers: the other groups of the row get finer steps
    x[1::4, 32:64] = 0.0  # a group of zeros
    return x


# 37 blocks of 16 (odd: a tile of fewer blocks at the end), H = 100: a last group of 4 inputs
SHAPES = [(592, 100), (1024, 576)]


@IMPLEMENTATIONS
@pytest.mark.parametrize("vocab, hidden", SHAPES)
@pytest.mark.parametrize("bits", [8, 14])
def test_a_row_has_the_same_bits_alone_and_in_any_call_of_2_to_64_rows(name, vocab, hidden, bits):
    weight, codes, buffers = screen_inputs(vocab, hidden, seed=vocab + hidden)
    x = activations(64, hidden)
    with kernel(name, bits) as ext:
        packed = ext.int8_screen_pack(codes)
        alone = [ext.int8_screen(x[r : r + 1], packed, *buffers) for r in range(64)]
        greedy_alone = [torch.ops.eyas.int8_screen_greedy(x[r : r + 1], packed, *buffers, weight) for r in range(64)]
        for rows in range(2, 65):
            start = (7 * rows) % (65 - rows)  # a different slice for each T
            approx, bound = ext.int8_screen(x[start : start + rows], packed, *buffers)
            greedy = torch.ops.eyas.int8_screen_greedy(x[start : start + rows], packed, *buffers, weight)
            for r in range(rows):
                assert torch.equal(approx[r], alone[start + r][0][0]), (rows, r)
                assert torch.equal(bound[r], alone[start + r][1][0]), (rows, r)
                assert torch.equal(greedy[r], greedy_alone[start + r][0]), (rows, r)


@IMPLEMENTATIONS
def test_streamed_and_cached_stores_give_the_same_results(name):
    """The greedy and candidate screens write approx and bound around the caches by default;
    through them (the comparison setting) the greedy rows and the candidates are the same."""
    weight, codes, buffers = screen_inputs(1024, 576, seed=21)
    x = activations(19, 576)
    with kernel(name) as ext:
        packed = ext.int8_screen_pack(codes)
        assert ext.screen_streams()
        results = {}
        try:
            for streaming in (True, False):
                ext.set_screen_streaming(streaming)
                results[streaming] = [torch.ops.eyas.int8_screen_candidates(x[:rows], packed, *buffers)
                                      for rows in (1, 6, 19)]
                results[streaming] += [(torch.ops.eyas.int8_screen_greedy(x[:rows], packed, *buffers, weight),)
                                       for rows in (1, 6, 19)]
        finally:
            ext.set_screen_streaming(True)
    for ours, theirs in zip(results[True], results[False], strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [8, 14])
def test_avx2_and_avx512vnni_screens_give_the_same_bits_for_every_row_count(bits):
    weight, codes, buffers = screen_inputs(592, 100, seed=11)
    x = activations(13, 100)
    results = {}
    for name in ("avx512vnni", "avx2"):
        with kernel(name, bits) as ext:
            packed = ext.int8_screen_pack(codes)
            results[name] = [ext.int8_screen(x[:rows], packed, *buffers) for rows in (1, 2, 3, 4, 5, 7, 13)]
            results[name] += [(torch.ops.eyas.int8_screen_greedy(x, packed, *buffers, weight),)]
    for ours, theirs in zip(results["avx512vnni"], results["avx2"], strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)


@IMPLEMENTATIONS
@pytest.mark.parametrize("bits", [8, 14])
def test_the_greedy_argmax_is_the_exhaustive_float64_argmax_and_candidates_are_exact(name, bits):
    """Near-ties, an exact tie (the first index wins, as torch.argmax), rows of different norms
    and outlier inputs: the bound holds for every logit, the greedy row's argmax is the float64
    argmax, and every candidate holds its float64 logit rounded once to float32."""
    weight, _, _ = screen_inputs(4096, 192, seed=3)
    weight[2000] = weight[17]  # an exact tie
    weight[3001] = weight[40] * (1 + 3e-7)  # a near-tie far below int8 resolution
    scale = (weight.abs().amax(1) / 127).to(torch.bfloat16).float()
    codes = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    approx_weight = codes.float() * scale[:, None]
    buffers = (scale, codes.sum(1, dtype=torch.int32), (weight - approx_weight).norm(dim=1),
               approx_weight.norm(dim=1))
    x = torch.cat([weight[17:18] * 30, weight[40:41] * 30, activations(30, 192)])  # [32, H]
    exact = x.double() @ weight.double().t()  # [R, V]
    with kernel(name, bits) as ext:
        packed = ext.int8_screen_pack(codes)
        approx, bound = ext.int8_screen(x, packed, *buffers)
        greedy = torch.ops.eyas.int8_screen_greedy(x, packed, *buffers, weight)
    assert bool(((exact - approx.double()).abs() <= bound.double()).all())
    assert torch.equal(greedy.argmax(-1), exact.float().argmax(-1))
    assert int(greedy.argmax(-1)[0]) == 17
    candidates = approx + bound >= (approx - bound).amax(1, keepdim=True)  # [R, V]
    assert torch.equal(greedy[candidates], exact.float()[candidates])
    assert torch.equal(greedy[~candidates], approx[~candidates])


@IMPLEMENTATIONS
def test_the_candidates_are_the_logits_whose_interval_reaches_the_best_lower_bound(name):
    """int8_screen_candidates (for output layers whose float32 rows are read on demand): the same
    approximate logits as int8_screen, and exactly the (row, column) pairs the re-check visits."""
    weight, codes, buffers = screen_inputs(592, 100, seed=5)
    x = torch.cat([weight[9:10] * 30, activations(6, 100)])  # [7, H]
    with kernel(name) as ext:
        packed = ext.int8_screen_pack(codes)
        approx, bound = ext.int8_screen(x, packed, *buffers)
        ours, rows, columns = torch.ops.eyas.int8_screen_candidates(x, packed, *buffers)
    expected_rows, expected_columns = (approx + bound >= (approx - bound).amax(1, keepdim=True)).nonzero(as_tuple=True)
    assert torch.equal(ours, approx)
    assert torch.equal(rows, expected_rows) and torch.equal(columns, expected_columns)
    best = (x.double() @ weight.double().t()).argmax(1)  # [R]
    for r in range(7):  # every row's argmax is among its candidates
        assert int(best[r]) in columns[rows == r].tolist()
