"""Statistical checks shared by the sampling tests."""

from __future__ import annotations

import torch


def homogeneity_p_value(first: dict[int, int], second: dict[int, int]) -> tuple[float, int]:
    """Chi-square test of homogeneity between two histograms of tokens: (p-value, degrees of
    freedom), over the tokens whose expected count is at least 5 in both samples."""
    keys = sorted(set(first) | set(second))
    table = torch.tensor([[first.get(k, 0) for k in keys], [second.get(k, 0) for k in keys]],
                         dtype=torch.float64)
    expected = table.sum(0, keepdim=True) * table.sum(1, keepdim=True) / table.sum()
    keep = expected.min(0).values >= 5
    statistic = ((table - expected) ** 2 / expected)[:, keep].sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0)), dof
