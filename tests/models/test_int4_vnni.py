"""The int4 x int8 VNNI kernel (models/csrc/int4_gemm.cpp): its products equal the documented
integer arithmetic, a row's output is the same alone and in any batch, and Int4Linear takes
its layout where the CPU has the instructions."""

import os
import shutil
from unittest import mock

import pytest
import torch
from torch import nn

from eyas.models import fused_cpu
from eyas.models.quant import Int4Linear, int4_available, quantize_groups

pytestmark = [
    pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this PyTorch"),
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                       reason="no C++ compiler to build the extension"),
]


def vnni():
    if not fused_cpu.vnni_available():
        pytest.skip("this CPU has no AVX512-VNNI (or EYAS_FUSED/EYAS_VNNI=0)")
    return fused_cpu.extension()


def reference(x, codes, scale, minimum):
    """The kernel's arithmetic in float64: 14-bit activations per group of 32 (x = d * xq,
    d = max|x| / 8191), float16 scales and minimums, the minimum times the exact sum of x."""
    rows, out = x.shape[0], codes.shape[0]
    groups = x.float().reshape(rows, -1, 32)  # [N, G, 32]
    amax = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 8191.0 / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inverse).double()  # [N, G, 32] in -8191..8191
    d = (amax / 8191).double().squeeze(-1)  # [N, G]
    dots = torch.einsum("ngk,ogk->nog", xq, codes.double().reshape(out, -1, 32))  # [N, O, G]
    s, m = scale.half().double(), minimum.half().double()  # [O, G]
    return (dots * d[:, None] * s[None]).sum(-1) + (groups.double().sum(-1)[:, None] * m[None]).sum(-1)


def test_the_kernel_computes_the_documented_integer_arithmetic():
    ext = vnni()
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    codes, scale, minimum = quantize_groups(weight, 32)
    packed = ext.int4_vnni_pack(codes, scale, minimum)
    assert packed.shape == (6, 4, 320) and packed.dtype == torch.uint8
    x = torch.randn(11, 128) * torch.logspace(-2, 1, 128)  # activations of very different sizes
    x[3] = 0.0  # a row of zeros: scale 0, no division by zero
    y = ext.int4_vnni_linear(x, packed)  # [11, 96]
    expected = reference(x, codes, scale, minimum)
    assert y.shape == (11, 96) and y.dtype == torch.float32
    assert torch.equal(y[3], torch.zeros(96))
    # float32 accumulation over 4 groups; a tie in round() may move one code by one step
    assert (y.double() - expected).abs().max() <= 1e-4 * expected.abs().max()
    # and it is the product with the dequantized weights, up to the 14-bit activations
    dequantized = (codes.float().reshape(96, 4, 32) * scale.half().float()[..., None]
                   + minimum.half().float()[..., None]).reshape(96, 128)
    assert (y - x @ dequantized.t()).abs().max() <= 1e-3 * (x @ dequantized.t()).abs().max()


def test_a_row_gets_the_same_bits_alone_and_in_any_batch():
    """Tiles of 8 rows: 13 rows run as 8 + 5; each row must equal its one-row product."""
    ext = vnni()
    torch.manual_seed(1)
    codes, scale, minimum = quantize_groups(torch.randn(48, 64), 32)
    packed = ext.int4_vnni_pack(codes, scale, minimum)
    x = torch.randn(13, 64)
    together = ext.int4_vnni_linear(x, packed)
    for row in range(13):
        assert torch.equal(ext.int4_vnni_linear(x[row : row + 1], packed)[0], together[row])
    assert torch.equal(ext.int4_vnni_linear(x[5:9], packed), together[5:9])


def test_packing_rejects_shapes_and_codes_it_cannot_hold():
    ext = vnni()
    codes, scale, minimum = quantize_groups(torch.randn(40, 64), 32)  # 40 outputs: not 16k
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.int4_vnni_pack(codes, scale, minimum)
    codes, scale, minimum = quantize_groups(torch.randn(16, 64), 32)
    with pytest.raises(RuntimeError, match="0..15"):
        ext.int4_vnni_pack(codes + 1, scale, minimum)
    packed = ext.int4_vnni_pack(codes, scale, minimum)
    with pytest.raises(RuntimeError, match="input width 96"):
        ext.int4_vnni_linear(torch.randn(2, 96), packed)


def test_int4_linear_takes_the_vnni_layout_where_it_can_and_both_layouts_agree():
    vnni()
    torch.manual_seed(2)
    linear = nn.Linear(128, 64, bias=True)
    fast = Int4Linear(linear)
    with mock.patch.dict(os.environ, {"EYAS_VNNI": "0"}):
        slow = Int4Linear(linear)
    assert (fast.layout, slow.layout) == ("vnni", "torch")
    assert fast.packed.shape == (4, 4, 320)
    x = torch.randn(3, 5, 128)
    exact = linear(x)
    # both approximate the same int4 weights; the vnni path's activations are finer than bf16
    assert (fast(x) - exact).abs().max() <= 0.1 * exact.abs().max()
    assert (fast(x) - slow(x)).abs().max() <= 0.02 * exact.abs().max()
    assert fast(x).shape == (3, 5, 64)
    assert Int4Linear(linear, group_size=64).layout == "torch"  # the kernel's groups are 32
