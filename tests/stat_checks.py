"""Statistical checks shared by the sampling tests."""

from __future__ import annotations

import torch


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts under probs (categories with expected count >= 5)."""
    expected = probs * counts.sum()
    keep = expected >= 5
    statistic = (((counts - expected) ** 2) / expected)[keep].sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0))


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


def goodness_of_fit(counts: dict[tuple, int], probs: dict[tuple, float]) -> tuple[float, int]:
    """Chi-square goodness of fit of observed counts against exact probabilities (keys: tokens
    or sequences of tokens): (p-value, degrees of freedom). Keys expected fewer than 5 times
    are pooled into one category (kept when the pool is expected 5 times or more)."""
    total = sum(counts.values())
    assert set(counts) <= set(probs), f"sequences the target cannot produce: {set(counts) - set(probs)}"
    observed, expected, pool_o, pool_e = [], [], 0.0, 0.0
    for seq, p in probs.items():
        if p * total >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(p * total)
        else:
            pool_o += counts.get(seq, 0)
            pool_e += p * total
    if pool_e >= 5:
        observed.append(pool_o)
        expected.append(pool_e)
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    statistic = ((o - e) ** 2 / e).sum()
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0)), dof


@torch.inference_mode()
def exact_joint(target, prompt: list[int], params, length: int) -> dict[tuple, float]:
    """P(first `length` answer tokens = seq) for every seq the sampler (`params`: a
    SamplingParams with top-k) can produce, by enumerating the prefixes on `target`."""
    from eyas.engine.generate import new_cache
    from eyas.engine.sampling import target_probs

    def next_probs(prefix: list[int]) -> torch.Tensor:
        ids = torch.tensor([prefix])
        logits = target.model(ids, cache=new_cache(target, 1, len(prefix)), write_at=0,
                              logits_at="last").logits[:, -1]
        return target_probs(logits, params)[0].double()

    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, p in joint.items():
            probs = next_probs(prompt + list(seq))
            for token in torch.nonzero(probs).flatten().tolist():
                grown[seq + (token,)] = p * float(probs[token])
        joint = grown
    return joint
