"""The output layer's int8 rows, computed a block of rows at a time, equal the whole-matrix
computation bit for bit (each row depends on itself alone)."""

import torch

from eyas.models.output_layer import _int8_rows


def test_int8_rows_by_blocks_equal_the_whole_matrix():
    torch.manual_seed(0)
    weight = torch.randn(3001, 96) * 0.1  # [V, H]
    weight[7] = 0  # an all-zero row: the scale's floor
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16)
    codes = (weight / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    approx = codes.float() * scale.float()[:, None]
    whole = (codes, scale, (weight - approx).norm(dim=1), approx.norm(dim=1))
    for rows_per_chunk in (8192, 1000, 7):
        for expected, got in zip(whole, _int8_rows(weight, rows_per_chunk)):
            assert torch.equal(expected, got)
