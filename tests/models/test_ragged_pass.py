"""A ragged pass of the int4 target (csrc/int4_stack.cpp Int4Stack with `sequences`):
the queries of several sequences, each with its own number of rows, its own KV cache row, slots
and context, in one call with no padding. Each row must get the bits it gets alone and in the
padded dense batch, and write the same keys and values, on each int8 dot-product
implementation."""

import copy
import shutil

import pytest
import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.models.kv_cache import KVCache
from eyas.models.quant import int4_available
from eyas.scheduler.batch import RowInput, build_decode_batch, build_ragged_batch
from test_fused_stack import CONTEXT, kernel

pytestmark = [
    pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this PyTorch"),
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                       reason="no C++ compiler to build the fused layer"),
]

CONTEXTS = (12, 31, 60)  # one per sequence: their own slots and lengths
TREE_SIZES = (0, 4, 8)  # draft nodes: a plain row, a tree of 4, a tree of 8
ROOTS = (2683, 314, 1345)


def random_tree(size: int, seed: int) -> DraftTree:
    """`size` nodes, each a child of the root or of an earlier node."""
    generator = torch.Generator().manual_seed(seed)
    parents = [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, size + 1)]
    return DraftTree(torch.randint(0, 49152, (size,), generator=generator), torch.tensor(parents, dtype=torch.long))


def new_cache(target, rows: int, slots: int = 96) -> KVCache:
    config = target.config
    return KVCache(config.num_hidden_layers, rows, config.num_key_value_heads, slots, config.head_dim,
                   dtype=target.kv_dtype)


def row_view(cache: KVCache, row: int) -> KVCache:
    view = copy.copy(cache)
    view.keys, view.values = cache.keys[:, row : row + 1], cache.values[:, row : row + 1]
    return view


def prefilled(target, rows: dict[int, int], total_rows: int) -> KVCache:
    """A cache whose row rows[s] holds the context of sequence s."""
    cache = new_cache(target, total_rows)
    for sequence, row in rows.items():
        target.model(CONTEXT[:, : CONTEXTS[sequence]], cache=row_view(cache, row), write_at=0, logits_at=None)
    return cache


def run(target, batch, cache) -> torch.Tensor:
    return target.model(batch.input_ids, batch.positions, cache=cache, kv_len=batch.kv_len,
                        **batch.pass_arguments(), logits_at=None).hidden


@pytest.mark.parametrize("name", ["avx512vnni", "avx2"])
def test_each_sequence_of_a_ragged_pass_gets_the_bits_it_gets_alone_and_in_a_dense_batch(smollm_int4_target,
                                                                                          name):
    target = smollm_int4_target
    trees = [random_tree(size, seed) for seed, size in enumerate(TREE_SIZES)]
    sizes = [1 + tree.size for tree in trees]
    with kernel(name), torch.inference_mode():
        # 1. Each sequence alone: the dense pass of one row, in its own cache.
        alone, alone_caches = [], []
        for sequence in range(3):
            cache = prefilled(target, {sequence: 0}, 1)
            batch = build_decode_batch([RowInput(0, CONTEXTS[sequence], ROOTS[sequence], trees[sequence])])
            alone.append(run(target, batch, cache)[0])  # [T, H]
            alone_caches.append(cache)
        # 2. The dense batch: rows 0..2 padded to the longest tree (T = 9), plus an idle row.
        dense_cache = prefilled(target, {0: 0, 1: 1, 2: 2}, 4)
        inputs = [RowInput(row, CONTEXTS[row], ROOTS[row], trees[row]) for row in range(3)]
        dense = build_decode_batch(inputs + [RowInput(3, 0, None)])
        dense_hidden = run(target, dense, dense_cache)[dense.query_rows, dense.query_cols]  # [N, H]
        # 3. The ragged pass: sequences in KV rows 3, 0, 2 (out of order, row 1 not in it),
        # listed longest tree first; N = 1 + 5 + 9 rows, no padding.
        rows = [3, 0, 2]
        ragged_cache = prefilled(target, dict(enumerate(rows)), 4)
        order = [2, 0, 1]
        ragged = build_ragged_batch([RowInput(rows[s], CONTEXTS[s], ROOTS[s], trees[s]) for s in order])
        ragged_hidden = run(target, ragged, ragged_cache)[0]  # [N, H]
    assert ragged.input_ids.shape == (1, sum(sizes)) and ragged.offsets == [0, 9, 10]
    assert ragged.sequences.tolist() == [2] * 9 + [3] + [0] * 5
    for position, sequence in enumerate(order):
        start, size = ragged.offsets[position], sizes[sequence]
        mine = ragged_hidden[start : start + size]
        assert torch.equal(mine, alone[sequence]), f"sequence {sequence}: ragged != alone"
        dense_start = dense.offsets[sequence]
        assert torch.equal(dense_hidden[dense_start : dense_start + size], alone[sequence])
        # the keys and values it wrote, at its own slots of its own row
        used = CONTEXTS[sequence] + size
        assert torch.equal(ragged_cache.keys[:, rows[sequence], :, :used], alone_caches[sequence].keys[:, 0, :, :used])
        assert torch.equal(ragged_cache.values[:, rows[sequence], :, :used],
                           alone_caches[sequence].values[:, 0, :, :used])
    assert not ragged_cache.keys[:, 1].any()  # a row outside the pass is left alone


def test_a_ragged_pass_of_one_token_per_sequence_equals_the_dense_plain_step(smollm_int4_target):
    """The plain step in both forms (B rows of one token): the same bits, rows in any order."""
    target = smollm_int4_target
    with torch.inference_mode():
        placement = {0: 0, 1: 1, 2: 2}
        dense_cache, ragged_cache = prefilled(target, placement, 3), prefilled(target, placement, 3)
        inputs = [RowInput(row, CONTEXTS[row], ROOTS[row]) for row in range(3)]
        dense = run(target, build_decode_batch(inputs), dense_cache)[:, 0]  # [3, H]
        ragged = run(target, build_ragged_batch(inputs[::-1]), ragged_cache)[0]  # rows 2, 1, 0
    assert torch.equal(ragged, dense.flip(0))
    assert torch.equal(ragged_cache.keys, dense_cache.keys) and torch.equal(ragged_cache.values, dense_cache.values)


def test_a_ragged_pass_checks_its_sequences(smollm_int4_target):
    target = smollm_int4_target
    batch = build_ragged_batch([RowInput(5, 4, ROOTS[0])])  # KV row 5 of a 2-row cache
    with torch.inference_mode(), pytest.raises(Exception, match="cache layers must be"):
        run(target, batch, new_cache(target, 2))
