"""The fused layers' attention alone (csrc/attention.cpp through the extension's `attention`):
a query's output depends only on the keys and values it may see, in order. Computed alone it
has the bits it has inside a prefill chunk of 256 rows, a random draft tree or a ragged pass of
several sequences, whatever the slots its keys sit in and whatever kv_len, on a float32 and a
float16 cache; and it is softmax attention (a float64 reference agrees to float32 rounding)."""

import shutil

import pytest
import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.tree import tree_mask as draft_tree_mask
from eyas.models import extension

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build the extension")

HEADS, KV_HEADS = 9, 3  # SmolLM2-135M's: a GQA group of 3


def kernel():
    ext = extension.module()
    if ext is None or not hasattr(ext, "attention"):
        pytest.skip("no C++ extension here")
    return ext


def cache(slots: int, head_dim: int, dtype: torch.dtype, seed: int, batch: int = 1):
    """keys, values [B, KV, S, D] with entries of both signs and spread magnitudes."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, KV_HEADS, slots, head_dim, generator=generator) * 1.5
    values = torch.randn(batch, KV_HEADS, slots, head_dim, generator=generator)
    return keys.to(dtype), values.to(dtype)


def queries(rows: int, head_dim: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, HEADS, head_dim, generator=torch.Generator().manual_seed(seed)) * 2  # [N, Hq, D]


def causal_mask(context: int, rows: int) -> torch.Tensor:
    """A prefill chunk of `rows` after `context` cached tokens: row t sees slots 0 .. context + t."""
    return torch.arange(context + rows)[None, :] <= (context + torch.arange(rows))[:, None]  # [T, context + T]


def tree_mask(context: int, size: int, seed: int) -> torch.Tensor:
    """A random draft tree of `size` nodes after `context` (node 0 the root, each later node a
    child of an earlier one): each node sees the context, its ancestors and itself."""
    generator = torch.Generator().manual_seed(seed)
    parents = torch.tensor([int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, size)],
                           dtype=torch.long)
    tree = DraftTree(torch.zeros(size - 1, dtype=torch.long), parents)
    return torch.cat([torch.ones(size, context, dtype=torch.bool), draft_tree_mask(tree)], dim=1)  # [T, context + T]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def reference(q, keys, values, mask, sequences) -> torch.Tensor:
    """Softmax attention in float64: [N, Hq, D]."""
    group = HEADS // KV_HEADS
    out = torch.empty(q.shape, dtype=torch.float64)
    for row in range(q.shape[0]):
        k = keys[sequences[row], :, : mask.shape[1]][:, mask[row]].double().repeat_interleave(group, 0)  # [Hq, n, D]
        v = values[sequences[row], :, : mask.shape[1]][:, mask[row]].double().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hnd->hn", q[row].double(), k) / q.shape[-1] ** 0.5
        out[row] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v)
    return out


def gapped_block_mask() -> torch.Tensor:
    """Three rows over 64 shared slots whose next chunk holds slots 64, 66, 79 (one short block
    whose first and last slots are 15 apart over gaps) or its first one or two: rows enough to
    share a transposed tile, which must not read the block as 16 consecutive slots."""
    mask = torch.zeros(3, 80, dtype=torch.bool)
    mask[:, :64] = True
    for row, seen in enumerate(([64, 66, 79], [64], [64, 66])):
        mask[row, seen] = True
    return mask


CASES = {
    "a short block over gaps, first and last slots 15 apart": gapped_block_mask,
    "one token": lambda: causal_mask(257, 1),
    "prefill chunk of 256 rows after 256": lambda: causal_mask(256, 256),
    "prefill chunk of 37 rows after 5": lambda: causal_mask(5, 37),
    "tree of 33 after 256": lambda: tree_mask(256, 33, seed=1),
    "tree of 64 after 300": lambda: tree_mask(300, 64, seed=2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_a_query_alone_gets_the_bits_it_gets_in_the_pass(case, dtype):
    ext = kernel()
    mask = CASES[case]()
    rows, kv_len = mask.shape
    keys, values = cache(kv_len + 16, 64, dtype, seed=3)
    q = queries(rows, 64, seed=4)
    sequences = torch.zeros(rows, dtype=torch.long)
    together = ext.attention(q, keys, values, mask, sequences)
    expected = reference(q, keys, values, mask, sequences)
    assert (together.double() - expected).abs().max() < 1e-5
    mismatched = []
    for row in range(rows):
        alone = ext.attention(q[row: row + 1], keys, values, mask[row: row + 1], sequences[:1])
        if not torch.equal(bits(alone[0]), bits(together[row])):
            mismatched.append(row)
    assert not mismatched, f"rows {mismatched[:10]} of {rows} differ from the row alone"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_query_gets_the_same_bits_wherever_its_keys_sit_and_whatever_kv_len(dtype):
    """A tree node reads its ancestors at their tree slots; after acceptance they sit in
    consecutive slots: the same keys in the same order give the same bits, with any number of
    trailing slots nobody sees."""
    ext = kernel()
    mask = tree_mask(130, 20, seed=5)
    keys, values = cache(mask.shape[1], 64, dtype, seed=6)
    q = queries(20, 64, seed=7)
    sequences = torch.zeros(20, dtype=torch.long)
    together = ext.attention(q, keys, values, mask, sequences)
    for row in (0, 7, 19):
        seen = mask[row].nonzero().flatten()
        compact_keys, compact_values = cache(seen.numel() + 40, 64, dtype, seed=8)
        compact_keys[:, :, : seen.numel()] = keys[:, :, seen]
        compact_values[:, :, : seen.numel()] = values[:, :, seen]
        for kv_len in (seen.numel(), seen.numel() + 40):
            compact = torch.arange(kv_len)[None] < seen.numel()  # [1, kv_len]
            alone = ext.attention(q[row: row + 1], compact_keys, compact_values, compact, sequences[:1])
            assert torch.equal(bits(alone[0]), bits(together[row])), (row, kv_len)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_ragged_pass_of_several_sequences_gives_each_row_its_bits_alone(dtype, head_dim):
    """Rows of three sequences (a plain step, a tree, a prefill chunk), each its own cache row."""
    ext = kernel()
    masks = [causal_mask(90, 1), tree_mask(140, 12, seed=9), causal_mask(60, 70)]
    kv_len = max(m.shape[1] for m in masks)
    mask = torch.cat([torch.nn.functional.pad(m, (0, kv_len - m.shape[1])) for m in masks])
    sequences = torch.cat([torch.full((m.shape[0],), b, dtype=torch.long) for b, m in enumerate(masks)])
    keys, values = cache(kv_len, head_dim, dtype, seed=10, batch=3)
    q = queries(mask.shape[0], head_dim, seed=11)
    together = ext.attention(q, keys, values, mask, sequences)
    assert (together.double() - reference(q, keys, values, mask, sequences)).abs().max() < 1e-5
    for row in range(mask.shape[0]):
        alone = ext.attention(q[row: row + 1], keys, values, mask[row: row + 1], sequences[row: row + 1])
        assert torch.equal(bits(alone[0]), bits(together[row])), row
