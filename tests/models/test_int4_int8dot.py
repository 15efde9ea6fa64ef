"""The int4 x int8 kernel (models/csrc/int4_gemm.cpp) and the output screen
(csrc/int8_screen.cpp), on each implementation this CPU's build has (AVX512-VNNI, AVX2): the
products equal the documented integer arithmetic, a row's output is the same alone and in any
batch, both implementations give the same bits (so a model decodes identically on either), and
Int4Linear takes the kernel's layout where the extension has one."""

import contextlib
import os
import shutil
import time
from unittest import mock

import pytest
import torch
from torch import nn

from eyas.models import extension
from eyas.models.quant import Int4Linear, int4_available, quantize_groups

pytestmark = [
    pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this PyTorch"),
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                       reason="no C++ compiler to build the extension"),
]

IMPLEMENTATIONS = pytest.mark.parametrize("name", ["avx512vnni", "avx2"])


def int8dot():
    if extension.int8dot_kernel() is None:
        pytest.skip("no int8 dot-product kernel here (no AVX2, or EYAS_FUSED=0 / EYAS_INT4_KERNEL=torch)")
    return extension.module()


@contextlib.contextmanager
def kernel(name):
    """Runs the block on implementation `name` of the extension, then restores the one in use."""
    ext = int8dot()
    if name not in ext.int8dot_kernels():
        pytest.skip(f"this CPU's build has no {name} kernel")
    before = ext.int8dot_kernel()
    ext.set_int8dot_kernel(name)
    try:
        yield ext
    finally:
        ext.set_int8dot_kernel(before)


@contextlib.contextmanager
def screen_bits(ext, bits):
    """Runs the block with the output screen's activations at `bits` (8 or 14), then restores them."""
    before = ext.screen_activation_bits()
    ext.set_screen_activation_bits(bits)
    try:
        yield ext
    finally:
        ext.set_screen_activation_bits(before)


def reference(x, codes, scale, minimum, levels=8191):
    """The kernel's arithmetic in float64: 14-bit activations per group of 32 (x = d * xq,
    d = max|x| / 8191; 8-bit: levels 127), float16 scales and minimums, the minimum times the
    exact sum of x."""
    rows, out = x.shape[0], codes.shape[0]
    groups = x.float().reshape(rows, -1, 32)  # [N, G, 32]
    amax = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inverse).double()  # [N, G, 32] in -levels..levels
    d = (amax / levels).double().squeeze(-1)  # [N, G]
    dots = torch.einsum("ngk,ogk->nog", xq, codes.double().reshape(out, -1, 32))  # [N, O, G]
    s, m = scale.half().double(), minimum.half().double()  # [O, G]
    return (dots * d[:, None] * s[None]).sum(-1) + (groups.double().sum(-1)[:, None] * m[None]).sum(-1)


@IMPLEMENTATIONS
def test_the_kernel_computes_the_documented_integer_arithmetic(name):
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    codes, scale, minimum = quantize_groups(weight, 32)
    x = torch.randn(11, 128) * torch.logspace(-2, 1, 128)  # activations of very different sizes
    x[3] = 0.0  # a row of zeros: scale 0, no division by zero
    with kernel(name) as ext:
        packed = ext.int4_pack(codes, scale, minimum)
        y = ext.int4_linear(x, packed)  # [11, 96]
    assert packed.shape == (6, 4, 320) and packed.dtype == torch.uint8
    expected = reference(x, codes, scale, minimum)
    assert y.shape == (11, 96) and y.dtype == torch.float32
    assert torch.equal(y[3], torch.zeros(96))
    # float32 accumulation over 4 groups; a tie in round() may move one code by one step
    assert (y.double() - expected).abs().max() <= 1e-4 * expected.abs().max()
    # and it is the product with the dequantized weights, up to the 14-bit activations
    dequantized = (codes.float().reshape(96, 4, 32) * scale.half().float()[..., None]
                   + minimum.half().float()[..., None]).reshape(96, 128)
    assert (y - x @ dequantized.t()).abs().max() <= 1e-3 * (x @ dequantized.t()).abs().max()


@IMPLEMENTATIONS
def test_eight_bit_activations_compute_their_documented_arithmetic_and_bits_per_row(name):
    """set_int4_activation_bits(8) (EYAS_INT4_ACTIVATIONS=8): one int8 operand per input; each
    row still equals its one-row product, and both implementations give the same bits."""
    torch.manual_seed(2)
    codes, scale, minimum = quantize_groups(torch.randn(96, 128) * 0.05, 32)
    x = torch.randn(11, 128) * torch.logspace(-2, 1, 128)
    with kernel(name) as ext:
        packed = ext.int4_pack(codes, scale, minimum)
        ext.set_int4_activation_bits(8)
        try:
            y = ext.int4_linear(x, packed)
            alone = [ext.int4_linear(x[row: row + 1], packed)[0] for row in range(11)]
            others = {}
            for other in ext.int8dot_kernels():
                ext.set_int8dot_kernel(other)
                others[other] = ext.int4_linear(x, packed)
            ext.set_int8dot_kernel(name)
        finally:
            ext.set_int4_activation_bits(14)
        fourteen = ext.int4_linear(x, packed)
    expected = reference(x, codes, scale, minimum, levels=127)
    assert (y.double() - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert not torch.equal(y, fourteen)  # the setting took effect, and was restored
    assert all(torch.equal(y[row], alone[row]) for row in range(11))
    assert all(torch.equal(y, other) for other in others.values())
    with pytest.raises(RuntimeError, match="14 or 8 bits"):
        ext.set_int4_activation_bits(4)


@IMPLEMENTATIONS
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(name):
    """Tiles of 8 rows (AVX512-VNNI) or 4 (AVX2): 13 rows run as 8 + 5 or 4 + 4 + 4 + 1; each
    row must equal its one-row product."""
    torch.manual_seed(1)
    codes, scale, minimum = quantize_groups(torch.randn(48, 64), 32)
    x = torch.randn(13, 64)
    with kernel(name) as ext:
        packed = ext.int4_pack(codes, scale, minimum)
        together = ext.int4_linear(x, packed)
        for row in range(13):
            assert torch.equal(ext.int4_linear(x[row : row + 1], packed)[0], together[row])
        assert torch.equal(ext.int4_linear(x[5:9], packed), together[5:9])


@IMPLEMENTATIONS
@pytest.mark.parametrize("bits", [14, 8])
def test_one_row_at_the_integer_extremes_gets_the_bits_of_its_row_in_a_tile(name, bits):
    """A one-row product has its own tile (int4_gemm.cpp one_row: the high nibbles multiplied in
    place, 16 times too large, and shifted back once): at the largest codes and activations of
    either sign, over Qwen2.5-1.5B's widest input (8,960), its integers stay exact, so the row
    equals the same row inside a tile of several rows, and the documented arithmetic."""
    groups = 280
    codes = torch.full((32, 32 * groups), 15, dtype=torch.int32)
    codes[:, 5::7] = 0
    codes[16:, 16:32] = 9  # other high nibbles in the second block of columns
    scale, minimum = torch.full((32, groups), 1e-3), torch.full((32, groups), -1e-2)
    x = torch.ones(4, 32 * groups)  # max|x| everywhere: xq = 8191 (or 127), hi = 64
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3] = torch.linspace(-3.0, 2.0, 32 * groups)
    with kernel(name) as ext:
        packed = ext.int4_pack(codes, scale, minimum)
        ext.set_int4_activation_bits(bits)
        try:
            together = ext.int4_linear(x, packed)  # [4, 32]
            alone = [ext.int4_linear(x[row : row + 1], packed)[0] for row in range(4)]
        finally:
            ext.set_int4_activation_bits(14)
    for row in range(4):
        assert torch.equal(alone[row], together[row])
    expected = reference(x, codes, scale, minimum, levels=8191 if bits == 14 else 127)
    assert (together.double() - expected).abs().max() <= 1e-4 * expected.abs().max()


def eight_bit_screen_reference(x, codes, scale):
    """csrc/int8_screen.cpp's 8-bit arithmetic in float64 and exact integers: per group g of 32
    inputs the largest shift s_g <= cap with 2^s_g max|x_g| <= max|x|, xq = round(x *
    (2^s_g 127 / max|x|)), T = sum_g 2^(cap - s_g) (codes . xq)_g exactly, then float32
    float(T) * (s * D) with D = (max|x| / 127) 2^-cap. Returns that, T [R, V] and D [R, 1]."""
    rows, hidden = x.shape
    groups = hidden // 32
    cap = 0
    while cap < 7 and groups * (32 * 127 * 127 << (cap + 1)) <= 2**31 - 1:
        cap += 1
    amax = x.abs().amax(1, keepdim=True)  # [R, 1]
    inverse, d = 127.0 / amax, amax / 127.0  # float32, as the kernel has them
    grouped = x.reshape(rows, groups, 32)
    gmax = grouped.abs().amax(-1)  # [R, G]
    shift = torch.zeros(rows, groups, dtype=torch.int64)
    for _ in range(cap):
        shift += ((shift < cap) & (gmax * 2.0 ** (shift + 1).float() <= amax)).long()
    xq = torch.round(grouped * (inverse[:, :, None] * 2.0 ** shift[:, :, None].float())).clamp(-127, 127)
    dots = torch.einsum("rgk,vgk->rvg", xq.double(), codes.double().reshape(-1, groups, 32))  # exact
    total = (dots * 2.0 ** (cap - shift[:, None, :]).double()).sum(-1)  # [R, V] exact integers
    step = d * 2.0 ** -cap  # [R, 1] float32, exact
    return total.float() * (scale[None] * step), total, step


@IMPLEMENTATIONS
def test_the_8bit_screen_is_the_documented_integer_arithmetic(name):
    """8-bit activations (csrc/int8_screen.cpp) with a power-of-two step per group of 32 inputs:
    the kernel's logits are eight_bit_screen_reference's bit for bit, including a T above 2^24
    (its conversion to float rounds) and rows whose outlier shifts the other groups."""
    torch.manual_seed(4)
    weight = torch.randn(256, 1536) * 0.05
    weight[0] = 0.05 * torch.randn(1536).sign()
    weight[0, :3] *= 0.6
    scale = (weight.abs().amax(1) / 127).to(torch.bfloat16).float()
    codes = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    x = torch.randn(6, 1536)
    x[1] = weight[0].sign() * 3.0  # codes . xq = 1533 * 127^2 + 3 * 127 * 76: odd, times 2^cap
    x[2, 7] = 60.0  # an outlier: every other group gets a finer step
    x[3, 128:160] = 0.0  # a group of zeros
    expected, total, step = eight_bit_screen_reference(x, codes, scale)
    assert total[1, 0] > 2**24 and total[1, 0].float().double() != total[1, 0]  # rounds to float
    exact = total * (scale.double()[None] * step.double())  # x^ . A_j
    with kernel(name) as ext, screen_bits(ext, 8):
        approx, bound = ext.int8_screen(x, ext.int8_screen_pack(codes), scale,
                                        codes.sum(1, dtype=torch.int32), torch.zeros(256), torch.zeros(256))
    assert torch.equal(approx, expected)
    assert bool(((approx.double() - exact).abs() <= bound.double()).all())  # float rounding bounded


def test_avx2_and_avx512vnni_give_the_same_bits():
    """The same integers and the same float operations in the same order (int8dot.h): a CPU
    without AVX-512 decodes exactly what this one does. Shapes of SmolLM2's projections, row
    counts across both tile sizes, and the output screen."""
    int8dot()
    torch.manual_seed(3)
    outputs = {}
    for name in ("avx512vnni", "avx2"):
        with kernel(name) as ext:
            torch.manual_seed(3)
            results = []
            for out, width in ((1728, 576), (576, 1536), (96, 128)):
                codes, scale, minimum = quantize_groups(torch.randn(out, width) * 0.05, 32)
                packed = ext.int4_pack(codes, scale, minimum)
                for rows in (1, 3, 5, 8, 13):
                    results.append(ext.int4_linear(torch.randn(rows, width) * 3, packed))
            weight = torch.randn(512, 576) * 0.05
            scale = (weight.abs().amax(1) / 127).to(torch.bfloat16)
            codes = (weight / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
            approx = codes.float() * scale.float()[:, None]
            x = torch.randn(6, 576)
            x[0, 5] = 40.0  # an outlier: the other inputs of its row get few levels
            exact = x @ weight.t()
            for bits in (14, 8):
                with screen_bits(ext, bits):
                    screened = ext.int8_screen(x, ext.int8_screen_pack(codes), scale.float(),
                                               codes.sum(1, dtype=torch.int32), (weight - approx).norm(dim=1),
                                               approx.norm(dim=1))
                assert bool(((exact - screened[0]).abs() <= screened[1]).all())  # the bound holds
                results += list(screened)
            outputs[name] = results
    for a, b in zip(outputs["avx512vnni"], outputs["avx2"], strict=True):
        assert torch.equal(a, b)


def test_a_model_decodes_the_same_bits_on_either_implementation(smollm_int4_target, mtbench_prompt_ids):
    """SmolLM2-135M int4, its fused layers and screened output layer: the hidden states of a
    prompt and the greedy tokens after it are identical on AVX512-VNNI and AVX2."""
    if smollm_int4_target.model.layers[0].mlp.down_proj.layout != "int8dot":
        pytest.skip("the int4 target does not use the int8dot layout here")
    ids = torch.tensor([mtbench_prompt_ids[0]])
    results = {}
    for name in ("avx512vnni", "avx2"):
        with kernel(name), torch.inference_mode():
            hidden = smollm_int4_target.model(ids, logits_at=None).hidden[0]  # [T, H]
            tokens = smollm_int4_target.model.lm_head.greedy_logits(hidden).argmax(-1)
            results[name] = (hidden, tokens)
    assert torch.equal(results["avx512vnni"][0], results["avx2"][0])
    assert torch.equal(results["avx512vnni"][1], results["avx2"][1])


def test_packing_rejects_shapes_and_codes_it_cannot_hold():
    ext = int8dot()
    codes, scale, minimum = quantize_groups(torch.randn(40, 64), 32)  # 40 outputs: not 16k
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.int4_pack(codes, scale, minimum)
    codes, scale, minimum = quantize_groups(torch.randn(16, 64), 32)
    with pytest.raises(RuntimeError, match="0..15"):
        ext.int4_pack(codes + 1, scale, minimum)
    packed = ext.int4_pack(codes, scale, minimum)
    with pytest.raises(RuntimeError, match="input width 96"):
        ext.int4_linear(torch.randn(2, 96), packed)
    with pytest.raises(RuntimeError, match="'avx9' is not in this build; it has: avx"):
        ext.set_int8dot_kernel("avx9")


def test_eyas_int4_kernel_chooses_the_implementation_and_refuses_unknown_names():
    ext = int8dot()
    before = ext.int8dot_kernel()
    try:
        with mock.patch.dict(os.environ, {"EYAS_INT4_KERNEL": "avx2"}):
            assert extension.int8dot_kernel() == "avx2" and ext.int8dot_kernel() == "avx2"
        with mock.patch.dict(os.environ, {"EYAS_INT4_KERNEL": "auto"}):
            assert extension.int8dot_kernel() == ext.int8dot_kernels()[0]  # the best built
        with mock.patch.dict(os.environ, {"EYAS_INT4_KERNEL": "torch"}):
            assert extension.int8dot_kernel() is None
        with mock.patch.dict(os.environ, {"EYAS_INT4_KERNEL": "avx"}), \
                pytest.raises(ValueError, match="accepted values are auto, avx512vnni, avx2, torch"):
            extension.int8dot_kernel()
    finally:
        ext.set_int8dot_kernel(before)


def test_eyas_pool_split_chooses_how_regions_are_handed_out_and_refuses_unknown_names():
    ext = int8dot()
    try:
        with mock.patch.dict(os.environ, {"EYAS_POOL_SPLIT": "chunks"}):
            assert extension.pool_split() == "chunks" and ext.pool_split() == "chunks"
        with mock.patch.dict(os.environ, {"EYAS_POOL_SPLIT": ""}):
            assert extension.pool_split() == "segments" and ext.pool_split() == "segments"
        with mock.patch.dict(os.environ, {"EYAS_POOL_SPLIT": "halves"}), \
                pytest.raises(ValueError, match="accepted values are segments, chunks"):
            extension.pool_split()
        with pytest.raises(RuntimeError, match="'segments' or 'chunks'"):
            ext.set_pool_split("halves")
    finally:
        ext.set_pool_split("segments")


def test_eyas_int4_prefetch_changes_no_value_and_refuses_unknown_names():
    """Streaming each group's lines ahead or bursting whole blocks ahead prefetches the same
    weights: the int4 and int8 products are the same bits either way, on both kernels, for one
    row and for tiles of rows, with blocks large (down-projection-like, 280 groups) and small."""
    ext = int8dot()
    torch.manual_seed(4)
    before = ext.int8dot_kernel()
    try:
        for out, width in ((16 * 40, 32 * 280), (16 * 300, 64)):
            codes = torch.randint(0, 16, (out, width))
            packed = ext.int4_pack(codes, torch.rand(out, width // 32) * 0.1, -torch.rand(out, width // 32) * 0.5)
            packed8 = torch.ops.eyas.int8_pack(torch.randint(-127, 128, (out, width), dtype=torch.int8),
                                               torch.rand(out, width // 32) * 0.01)
            x = torch.randn(11, width)
            for name in ext.int8dot_kernels():
                ext.set_int8dot_kernel(name)
                results = {}
                for mode in ("stream", "blocks"):
                    with mock.patch.dict(os.environ, {"EYAS_INT4_PREFETCH": mode}):
                        assert extension.int4_prefetch() == mode and ext.int4_prefetch() == mode
                    results[mode] = [ext.int4_linear(x[:1], packed), ext.int4_linear(x, packed),
                                     torch.ops.eyas.int8_linear(x[:1], packed8), torch.ops.eyas.int8_linear(x, packed8)]
                for streamed, burst in zip(results["stream"], results["blocks"]):
                    assert torch.equal(streamed, burst)
        with mock.patch.dict(os.environ, {"EYAS_INT4_PREFETCH": ""}):
            assert extension.int4_prefetch() == "stream" and ext.int4_prefetch() == "stream"
        with mock.patch.dict(os.environ, {"EYAS_INT4_PREFETCH": "lines"}), \
                pytest.raises(ValueError, match="accepted values are stream, blocks"):
            extension.int4_prefetch()
        with pytest.raises(RuntimeError, match="'stream' or 'blocks'"):
            ext.set_int4_prefetch("lines")
    finally:
        ext.set_int8dot_kernel(before)
        ext.set_int4_prefetch("stream")


def test_amx_tiles_give_the_vnni_bits_for_every_row_count():
    """Whole tiles of 16 rows go to AMX (csrc/int4_gemm.cpp), the rest to vpdpbusd: every row
    gets the bits of its one-row product and of the AMX-off product, at 14 and 8 bits, with
    blocks large and small, a row of zeros and rows at the activations' extremes included."""
    ext = int8dot()
    if not ext.int4_amx_available():
        with pytest.raises(RuntimeError, match="AMX is not available here"):
            ext.set_int4_amx(True)
        pytest.skip("no AMX on this CPU or build")
    torch.manual_seed(5)
    before = ext.int4_amx()
    try:
        for out, width in ((16 * 12, 32 * 40), (16 * 40, 64)):
            codes = torch.randint(0, 16, (out, width))
            codes[:16] = 15  # extreme codes under extreme activations: the largest integers
            packed = ext.int4_pack(codes, torch.rand(out, width // 32) * 0.1, -torch.rand(out, width // 32) * 0.5)
            x = torch.randn(70, width) * torch.logspace(-3, 2, width)
            x[5] = 0.0
            x[6] = torch.where(torch.arange(width) % 2 == 0, 1.0, -1.0)
            for bits in (14, 8):
                ext.set_int4_activation_bits(bits)
                for rows in (16, 17, 31, 32, 45, 70):
                    ext.set_int4_amx(False)
                    vnni = ext.int4_linear(x[:rows], packed)
                    ext.set_int4_amx(True)
                    amx = ext.int4_linear(x[:rows], packed)
                    assert torch.equal(amx, vnni), (bits, rows)
                alone = torch.stack([ext.int4_linear(x[row: row + 1], packed)[0] for row in range(70)])
                assert torch.equal(ext.int4_linear(x, packed), alone)
        with mock.patch.dict(os.environ, {"EYAS_INT4_AMX": "off"}):
            assert extension.int4_amx() is False and not ext.int4_amx()
        with mock.patch.dict(os.environ, {"EYAS_INT4_AMX": ""}):
            assert extension.int4_amx() is True and ext.int4_amx()
        with mock.patch.dict(os.environ, {"EYAS_INT4_AMX": "on"}), \
                pytest.raises(ValueError, match="accepted values are auto, off"):
            extension.int4_amx()
    finally:
        ext.set_int4_activation_bits(14)
        ext.set_int4_amx(before)


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_every_column_block_is_computed_once_on_any_thread_count_and_split(rows):
    """Each thread starts on its own segment of the columns and steals from the others' ends
    (csrc/worker_pool.h): with more threads than cores, or chunks in turn, the product is the
    one thread's, bit for bit."""
    ext = int8dot()
    torch.manual_seed(3)
    out, width = 16 * 301, 64  # 301 blocks of 16 columns: uneven segments
    packed = ext.int4_pack(torch.randint(0, 16, (out, width)), torch.rand(out, width // 32) * 0.1,
                           -torch.rand(out, width // 32) * 0.5)
    x = torch.randn(rows, width)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = ext.int4_linear(x, packed)
        for split in ("segments", "chunks"):
            ext.set_pool_split(split)
            for count in (2, 3, 7):
                torch.set_num_threads(count)
                for _ in range(3):
                    assert torch.equal(ext.int4_linear(x, packed), reference), (split, count)
    finally:
        torch.set_num_threads(threads)
        ext.set_pool_split("segments")


def test_workers_beyond_the_thread_count_are_not_woken():
    """After the thread count is lowered (7, then 2), a region wakes only the worker it runs on;
    the surplus workers sleep (csrc/worker_pool.h). Woken by every region, each spun for its
    while, and five spinning threads on 2 cores made every later int4 pass 2-3x slower."""
    ext = int8dot()
    torch.manual_seed(4)
    out, width = 16 * 64, 64
    packed = ext.int4_pack(torch.randint(0, 16, (out, width)), torch.rand(out, width // 32) * 0.1,
                           -torch.rand(out, width // 32) * 0.5)
    x = torch.randn(1, width)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(7)
        expected = ext.int4_linear(x, packed)  # six workers at least
        torch.set_num_threads(2)
        time.sleep(0.05)  # idle workers sleep after ~0.2 ms of spinning
        before = ext.pool_worker_wakeups()
        assert len(before) >= 6
        for _ in range(40):
            assert torch.equal(ext.int4_linear(x, packed), expected)
            time.sleep(0.002)  # long enough for the one worker to fall asleep in between
        after = ext.pool_worker_wakeups()
        assert after[0] > before[0]  # the worker a 2-thread region runs on, woken for it
        assert after[1:len(before)] == before[1:]  # the others never
    finally:
        torch.set_num_threads(threads)


def test_int4_linear_takes_the_int8dot_layout_where_it_can_and_both_layouts_agree():
    int8dot()
    torch.manual_seed(2)
    linear = nn.Linear(128, 64, bias=True)
    fast = Int4Linear(linear)
    with mock.patch.dict(os.environ, {"EYAS_INT4_KERNEL": "torch"}):
        slow = Int4Linear(linear)
    assert (fast.layout, slow.layout) == ("int8dot", "torch")
    assert fast.packed.shape == (4, 4, 320)
    x = torch.randn(3, 5, 128)
    exact = linear(x)
    # both approximate the same int4 weights; the int8dot path's activations are finer than bf16
    assert (fast(x) - exact).abs().max() <= 0.1 * exact.abs().max()
    assert (fast(x) - slow(x)).abs().max() <= 0.02 * exact.abs().max()
    assert fast(x).shape == (3, 5, 64)
    assert Int4Linear(linear, group_size=64).layout == "torch"  # the kernel's groups are 32


AVX2_BUILD_SCRIPT = """
import json, sys
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import load_target
from eyas.models import extension
sys.path.insert(0, sys.argv[1])
from test_int4_int8dot import fused_hidden_digest
target = load_target("smollm2-135m", dtype="int4")
prompts = json.loads(sys.stdin.read())
outputs = [list(generate(target, p, SamplingParams(max_tokens=64)).token_ids) for p in prompts]
hidden = {}
for kv in ("float32", "float16"):
    target.model.kv_dtype_choice = kv
    hidden[kv] = fused_hidden_digest(target, prompts[0] * 3)
print(json.dumps({"kernel": extension.module().int8dot_kernel(), "outputs": outputs, "hidden": hidden}))
"""


def fused_hidden_digest(target, ids: list[int]) -> str:
    """SHA-256 of the fused layers' hidden states for a prefill of `ids` (longer than one
    64-key attention chunk) and one decode step after it."""
    import hashlib

    from eyas.engine.generate import new_cache

    assert target.model.fused_layers() is not None
    cache = new_cache(target, 1, len(ids) + 2)
    with torch.inference_mode():
        prefill = target.model(torch.tensor([ids]), cache=cache, write_at=0, logits_at=None).hidden
        step = target.model(torch.tensor([[ids[0]]]), cache=cache, write_at=len(ids), logits_at=None).hidden
    return hashlib.sha256(torch.cat([prefill, step], 1).numpy().tobytes()).hexdigest()


@pytest.mark.slow
def test_an_avx2_only_build_decodes_the_tokens_of_this_build(smollm_int4_target, mtbench_prompt_ids):
    """EYAS_EXT_MARCH=haswell compiles the extension as a CPU without AVX-512 would (about 45 s
    the first time): its hidden states equal this build's bit for bit, over a float32 and a
    float16 KV cache (int4 kernel, screen and attention each compute the same operations on
    256- or 512-bit registers, and
    -ffp-contract=off keeps the compiler from fusing float operations differently per -march,
    extension.CFLAGS), so its greedy answers are the same tokens."""
    import json
    import subprocess
    import sys

    if smollm_int4_target.model.layers[0].mlp.down_proj.layout != "int8dot":
        pytest.skip("the int4 target does not use the int8dot layout here")
    from eyas.engine.generate import generate
    from eyas.engine.sampling import SamplingParams

    prompts = mtbench_prompt_ids[:3]
    here = [list(generate(smollm_int4_target, p, SamplingParams(max_tokens=64)).token_ids) for p in prompts]
    env = dict(os.environ, EYAS_EXT_MARCH="haswell")
    env.pop("EYAS_INT4_KERNEL", None)
    done = subprocess.run([sys.executable, "-c", AVX2_BUILD_SCRIPT, os.path.dirname(__file__)],
                          input=json.dumps(prompts), env=env, capture_output=True, text=True, timeout=900,
                          check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["kernel"] == "avx2"
    model = smollm_int4_target.model
    try:
        for kv in ("float32", "float16"):  # the KV cache either way (float16 widened by F16C or AVX-512)
            model.kv_dtype_choice = kv
            assert result["hidden"][kv] == fused_hidden_digest(smollm_int4_target, prompts[0] * 3)
    finally:
        model.kv_dtype_choice = "auto"
    assert result["outputs"] == here
