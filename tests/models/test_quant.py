"""Int4 matmul row splitting: which calls the kernel gets, and that splitting changes nothing."""

import pytest
import torch
from torch import nn

from eyas.models.quant import Int4Linear, int4_available, row_chunks


@pytest.mark.parametrize("rows, chunks", [
    (1, [1]), (4, [4]), (5, [4, 1]), (6, [4, 2]), (7, [7]), (8, [8]), (9, [8, 1]),
    (10, [8, 2]), (13, [12, 1]), (16, [16]), (17, [16, 1]), (21, [16, 4, 1]), (40, [16, 16, 8]),
])
def test_row_chunks_split_off_one_or_two_rows_past_a_block_of_four(rows, chunks):
    assert row_chunks(rows) == chunks
    assert sum(row_chunks(rows)) == rows


@pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this PyTorch")
def test_int4_rows_are_the_same_alone_and_in_any_split():
    torch.manual_seed(0)
    layer = Int4Linear(nn.Linear(64, 96, bias=True), group_size=32)
    x = torch.randn(2, 11, 64)  # 22 rows: 16 + 4 + 2
    together = layer(x)  # [2, 11, 96]
    alone = torch.cat([layer(x.reshape(-1, 64)[i : i + 1]) for i in range(22)]).reshape(2, 11, 96)
    assert together.shape == (2, 11, 96)
    assert torch.equal(together, alone)


@pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this PyTorch")
def test_the_python_layers_of_an_int4_target_keep_a_float64_cache_that_changes_no_logit(
        smollm_int4_target, smollm_target):
    """Without the fused layers (models/fused_cpu.py), float64 attention reads a float64 cache
    (no conversion of the whole cache per step); the values stored are the float32 keys and
    values made exact in float64, so every logit equals the one computed from a float32 cache."""
    from eyas.models.kv_cache import KVCache

    target = smollm_int4_target
    target.model.fused_plan = False  # the Python layers
    try:
        assert target.kv_dtype == torch.float64 and smollm_target.kv_dtype == torch.float32
        config = target.config
        prompt = torch.tensor([[1, 504, 3458, 314, 253, 1789, 28, 6120, 30, 260, 2114, 5549]])  # [1, 12]
        logits = {}
        with torch.inference_mode():
            for dtype in (torch.float32, torch.float64):
                cache = KVCache(config.num_hidden_layers, 1, config.num_key_value_heads, 16,
                                config.head_dim, dtype=dtype)
                first = target.model(prompt[:, :9], cache=cache, write_at=0).logits  # [1, 9, V]
                rest = target.model(prompt[:, 9:], cache=cache, write_at=9).logits  # [1, 3, V]
                logits[dtype] = torch.cat([first, rest], dim=1)
    finally:
        target.model.fused_plan = None  # look the fused layers up again
    assert logits[torch.float64].dtype == torch.float32
    assert torch.equal(logits[torch.float32], logits[torch.float64])


@pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this PyTorch")
def test_quantize_linears_swaps_the_layers_it_can_and_keeps_the_rest_float():
    from eyas.models.quant import quantize_linears

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Sequential(nn.Linear(96, 48), nn.Linear(48, 8)))
    x = torch.randn(3, 64)
    before = module(x)
    quantize_linears(module)
    assert [type(m).__name__ for m in (module[0], module[2][0], module[2][1])] == \
        ["Int4Linear", "Int4Linear", "Linear"]  # 48 inputs: not a multiple of the group of 32
    after = module(x)
    assert after.shape == before.shape
    assert torch.allclose(after, before, atol=0.1 * before.abs().max().item())
    assert not torch.equal(after, before)  # the weights really are 4-bit now
