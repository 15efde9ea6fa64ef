"""The batched verification pass: hand-built rows with known ids, positions, slots and masks."""

from __future__ import annotations

import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.scheduler.batch import RowInput, build_decode_batch, build_ragged_batch, tree_row


def test_two_requests_and_an_idle_row_in_one_pass():
    # row 0: context 3, root 10, tree: 11 under the root, 12 under 11, 13 under the root
    tree = DraftTree(torch.tensor([11, 12, 13]), torch.tensor([0, 1, 0]))
    rows = [RowInput(0, 3, 10, tree), RowInput(1, 2, None), RowInput(2, 5, 20)]  # 1 idle, 2 plain
    batch = build_decode_batch(rows)
    assert batch.input_ids.tolist() == [[10, 11, 12, 13], [0, 0, 0, 0], [20, 0, 0, 0]]
    assert batch.positions.tolist() == [[3, 4, 5, 4], [2, 2, 2, 2], [5, 5, 5, 5]]
    assert batch.write_slots.tolist() == [[3, 4, 5, 6], [2, 3, 4, 5], [5, 6, 7, 8]]
    assert batch.kv_len == 9
    mask = batch.attn_mask.int()
    # row 0: the context, then the tree block (root; 11 -> root; 12 -> 11 -> root; 13 -> root)
    assert mask[0].tolist() == [
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 0, 0],
    ]
    # idle row and padding queries: their own slot only
    assert mask[1].tolist() == [[1 if s == q + 2 else 0 for s in range(9)] for q in range(4)]
    assert mask[2, 0].tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 0]
    assert mask[2, 1].tolist() == [0, 0, 0, 0, 0, 0, 1, 0, 0]
    # logits are taken only at real queries: row 0's four, row 2's root
    assert batch.query_rows.tolist() == [0, 0, 0, 0, 2]
    assert batch.query_cols.tolist() == [0, 1, 2, 3, 0]
    assert batch.offsets == [0, 4, 4]


def test_tree_row_lays_out_one_row_as_the_general_builder_does():
    """`tree_row` (single-stream drafting steps, without a batch) gives the ids, positions and
    mask the general builder gives that row, alone and beside an idle row (which it pads), on
    random trees."""
    generator = torch.Generator().manual_seed(0)
    for size in (1, 2, 5, 9):
        parents = [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, size + 1)]
        tree = DraftTree(torch.randint(0, 1000, (size,), generator=generator), torch.tensor(parents))
        tokens, positions, mask = tree_row(42, tree, 7)
        for rows in ([RowInput(0, 7, 42, tree)], [RowInput(0, 7, 42, tree), RowInput(1, 3, None)]):
            batch = build_decode_batch(rows)
            assert batch.kv_len == 7 + size + 1 and mask.shape == (1, size + 1, batch.kv_len)
            assert batch.input_ids[0].tolist() == tokens and batch.positions[0].tolist() == positions
            assert torch.equal(batch.attn_mask[:1], mask)
            assert batch.write_slots[0].tolist() == list(range(7, 7 + size + 1))


def test_plain_rows_are_one_token_each():
    batch = build_decode_batch([RowInput(0, 4, 7), RowInput(1, 9, 8, DraftTree.empty())])
    assert batch.tokens_per_row == 1
    assert batch.positions.tolist() == [[4], [9]]
    assert batch.attn_mask[:, 0].sum(-1).tolist() == [5, 10]  # context + root


def test_a_ragged_pass_holds_each_request_s_queries_and_no_padding():
    # KV row 3: context 3, root 10, tree 11 under the root, 12 under 11, 13 under the root;
    # KV row 0: context 5, root 20, plain. Listed in that order: row 3's queries first.
    tree = DraftTree(torch.tensor([11, 12, 13]), torch.tensor([0, 1, 0]))
    batch = build_ragged_batch([RowInput(3, 3, 10, tree), RowInput(0, 5, 20)])
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, 20]]
    assert batch.positions.tolist() == [[3, 4, 5, 4, 5]]
    assert batch.write_slots.tolist() == [[3, 4, 5, 6, 5]]
    assert batch.sequences.tolist() == [3, 3, 3, 3, 0]
    assert batch.kv_len == 7 and batch.offsets == [0, 4]
    assert batch.attn_mask.int()[0].tolist() == [  # each over its own row's slots
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0, 1],
        [1, 1, 1, 1, 1, 1, 0],
    ]
    assert set(batch.pass_arguments()) == {"write_at", "attn_mask", "sequences"}


def test_ragged_plain_rows_see_their_context_and_own_slot_only():
    # KV row 1: context 0 (its first decoded token); row 4: context 2, an empty tree; row 0: context 3
    batch = build_ragged_batch([RowInput(1, 0, 7), RowInput(4, 2, 8, DraftTree.empty()), RowInput(0, 3, 9)])
    assert batch.input_ids.tolist() == [[7, 8, 9]] and batch.input_ids.dtype == torch.long
    assert batch.positions.tolist() == [[0, 2, 3]] and batch.write_slots.tolist() == [[0, 2, 3]]
    assert batch.sequences.tolist() == [1, 4, 0] and batch.offsets == [0, 1, 2]
    assert batch.kv_len == 4 and batch.attn_mask.dtype == torch.bool
    assert batch.attn_mask.int()[0].tolist() == [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
