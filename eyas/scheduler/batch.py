"""One target pass over every decoding request: [root + draft tree] of each.

The serving step's pass is ragged (`build_ragged_batch`): the queries of every decoding request
one after another, N = sum of (1 + draft nodes), no padding and no idle rows. Each query names
its sequence (KV cache row), its slot there and its position; its mask row covers that
sequence's cache only: the context slots [0, context) plus the tree mask over its own root and
nodes, written at slots context, context + 1, ...

    requests:  row 3  context 7, chain of 2      row 0  context 4, no draft (plain)
    N = 4      sequences 3 3 3 0   positions 7 8 9 4   write slots 7 8 9 4

The dense form (`build_decode_batch`, [B, T] padded to the longest tree) is what a pass of
one request runs (single-stream decoding), and what the model tests compare against.

Dense: row b of the pass is KV cache row b. Its queries are the root (the last emitted token) and the
draft nodes, padded to the pass length T; they are written at slots context_b, context_b + 1,
... of that row. Each row's mask is its own block: columns [0, context_b) (the committed
context) plus the tree mask over its own root and nodes; rows never see each other, since each
attends only to its own cache row (the batched form of a block-diagonal tree mask).
Padding queries (and idle rows inside the span) attend to their own slot only, so that no
softmax row is empty; their outputs are never read and their slots are scratch.

    rows:  b=0  context 7, chain of 2      b=1  context 4, no draft (plain)
    T = 3; positions b=0: 7 8 9            b=1: 4 4 4 (padding repeats the root's)
    write slots      b=0: 7 8 9            b=1: 4 5 6
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.tree import node_depths, tree_mask


@dataclass
class RowInput:
    row: int  # KV cache row
    context_length: int  # committed slots of that row
    root: int | None  # the root token; None for an idle row (padding only)
    tree: DraftTree | None = None  # drafts under the root (None or empty: a plain row)

    @property
    def size(self) -> int:
        """Real queries of the row: root + draft nodes (0 for an idle row)."""
        if self.root is None:
            return 0
        return 1 + (self.tree.size if self.tree is not None else 0)


@dataclass
class DecodeBatch:
    input_ids: Tensor  # [B, T] long
    positions: Tensor  # [B, T] long
    write_slots: Tensor  # [B, T] long: cache slot of each query in its own row
    attn_mask: Tensor | None  # [B, T, S] bool, S = kv_len; None: one row of one query (it
    # sees every slot up to kv_len)
    kv_len: int
    query_rows: Tensor  # [N] long: batch row of each real query (roots and nodes, row-major)
    query_cols: Tensor  # [N] long: its column in the pass
    offsets: list[int]  # per RowInput: where its real queries start among the N

    @property
    def tokens_per_row(self) -> int:
        return self.input_ids.shape[1]

    def pass_arguments(self) -> dict:
        """write_at and attn_mask for the target's forward. A pass of one row writes its
        queries at contiguous slots (an int start, as a single-stream pass); with one query
        as well (a plain step) it sees every slot up to kv_len and needs no mask."""
        if self.input_ids.shape[0] > 1:
            return {"write_at": self.write_slots, "attn_mask": self.attn_mask}
        return {"write_at": self.kv_len - self.tokens_per_row, "attn_mask": self.attn_mask}


def build_decode_batch(inputs: list[RowInput], device: torch.device | str = "cpu",
                       pad_id: int = 0) -> DecodeBatch:
    """`inputs` must cover rows 0..B-1 in order (idle rows included, with root None)."""
    assert [item.row for item in inputs] == list(range(len(inputs))), "rows must be 0..B-1"
    if len(inputs) == 1 and inputs[0].size == 1:  # one plain row (single-stream): no mask
        return one_plain_row(inputs[0], device)
    batch = len(inputs)
    length = max(max(item.size for item in inputs), 1)  # T
    contexts = torch.tensor([item.context_length for item in inputs], dtype=torch.long)  # [B]
    kv_len = int(contexts.max()) + length
    columns = torch.arange(length)  # [T]
    # 1. Slots and default (padding) positions: every query at context_b + column.
    write_slots = contexts[:, None] + columns[None, :]  # [B, T]
    positions = contexts[:, None].expand(batch, length).clone()  # [B, T]
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    # 2. Padding default: each query sees its own slot only.
    slot_index = torch.arange(kv_len)  # [S]
    mask = slot_index[None, None, :] == write_slots[:, :, None]  # [B, T, S]
    query_rows: list[int] = []
    query_cols: list[int] = []
    offsets: list[int] = []
    # 3. Real queries: context columns, then the row's tree block.
    for item in inputs:
        offsets.append(len(query_rows))
        size = item.size
        if size == 0:
            continue
        b, context = item.row, item.context_length
        tree = item.tree if item.tree is not None else DraftTree.empty()
        input_ids[b, 0] = item.root
        if tree.size:
            input_ids[b, 1:size] = tree.tokens
            positions[b, :size] = context + torch.tensor([0] + node_depths(tree))
        mask[b, :size, :context] = True
        mask[b, :size, context : context + size] = tree_mask(tree)
        query_rows.extend([b] * size)
        query_cols.extend(range(size))
    return DecodeBatch(
        input_ids=input_ids.to(device), positions=positions.to(device),
        write_slots=write_slots.to(device), attn_mask=mask.to(device), kv_len=kv_len,
        query_rows=torch.tensor(query_rows, dtype=torch.long, device=device),
        query_cols=torch.tensor(query_cols, dtype=torch.long, device=device), offsets=offsets,
    )


@dataclass
class RaggedBatch:
    input_ids: Tensor  # [1, N] long: every request's root, then its draft nodes
    positions: Tensor  # [1, N] long
    write_slots: Tensor  # [1, N] long: each query's slot in its own KV row
    sequences: Tensor  # [N] long: each query's KV row
    attn_mask: Tensor  # [1, N, S] bool, S = kv_len: the slots of its own KV row it may see
    kv_len: int
    offsets: list[int]  # per RowInput: where its queries start among the N

    def pass_arguments(self) -> dict:
        """write_at, attn_mask and sequences for the target's forward (a ragged pass)."""
        return {"write_at": self.write_slots, "attn_mask": self.attn_mask, "sequences": self.sequences}


def build_ragged_batch(inputs: list[RowInput], device: torch.device | str = "cpu") -> RaggedBatch:
    """The ragged pass over `inputs` (decoding requests: root set, each KV row at most once, in
    any order): their queries in that order.

    Built from Python lists in one go, then a few whole-tensor ops: a plain row (no draft) costs
    a handful of list appends, not a dozen small tensor writes (at 64 rows that was ~2 ms a step).
    Only the rows with a draft tree write their tree block into the mask one by one."""
    assert all(item.root is not None for item in inputs), "a ragged pass holds decoding rows only"
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []  # each query's slot in its own KV row
    sequences: list[int] = []
    contexts: list[int] = []  # each query's committed context (the slots [0, context) it sees)
    offsets: list[int] = []
    trees: list[tuple[int, int, DraftTree]] = []  # (first query, context, tree) of rows with drafts
    for item in inputs:
        offsets.append(len(ids))
        context, tree = item.context_length, item.tree
        if tree is None or tree.size == 0:  # a plain row: its root alone
            ids.append(item.root)
            positions.append(context)
            slots.append(context)
            sequences.append(item.row)
            contexts.append(context)
            continue
        size = 1 + tree.size
        trees.append((len(ids), context, tree))
        ids.append(item.root)
        ids.extend(tree.tokens.tolist())
        positions.append(context)
        positions.extend(context + depth for depth in node_depths(tree))
        slots.extend(range(context, context + size))
        sequences.extend([item.row] * size)
        contexts.extend([context] * size)
    count = len(ids)
    kv_len = max(slot + 1 for slot in slots)
    write_slots = torch.tensor(slots, dtype=torch.long)  # [N]
    # 1. Every query sees its row's committed context and its own slot (the diagonal of its
    # tree mask); 2. a draft node also sees its ancestors (the rest of the tree mask).
    mask = torch.arange(kv_len)[None, :] < torch.tensor(contexts, dtype=torch.long)[:, None]  # [N, S]
    mask[torch.arange(count), write_slots] = True
    for start, context, tree in trees:
        size = 1 + tree.size
        mask[start : start + size, context : context + size] = tree_mask(tree)
    return RaggedBatch(input_ids=torch.tensor([ids], dtype=torch.long, device=device),
                       positions=torch.tensor([positions], dtype=torch.long, device=device),
                       write_slots=write_slots[None].to(device),
                       sequences=torch.tensor(sequences, dtype=torch.long, device=device),
                       attn_mask=mask[None].to(device), kv_len=kv_len, offsets=offsets)


def tree_row(root: int, tree: DraftTree, context: int) -> tuple[list[int], list[int], Tensor]:
    """One row's pass over its root and draft tree, as the general builder lays it out, without
    its PyTorch ops (~15, ~0.3 ms a step as they run cold after each pass): its tokens [T] and
    positions [T] (context + depth) as ints, and its mask [1, T, context + T] bool, each query
    seeing the context, its ancestors and itself (written at slots context..)."""
    size = tree.size + 1
    mask = np.empty((1, size, context + size), dtype=bool)  # [1, T, kv_len]
    mask[0, :, :context] = True
    mask[0, :, context:] = tree_mask(tree).numpy()
    positions = [context] + [context + depth for depth in node_depths(tree)]
    return [root] + tree.tokens.tolist(), positions, torch.from_numpy(mask)


def one_plain_row(item: RowInput, device: torch.device | str) -> DecodeBatch:
    """The pass of one row holding only its root: written at slot context, seeing slots
    [0, context] (every slot up to kv_len: no mask), as single-stream decoding runs it."""
    context = item.context_length
    slots = torch.tensor([[context]], dtype=torch.long, device=device)  # [1, 1]
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return DecodeBatch(input_ids=torch.tensor([[item.root]], dtype=torch.long, device=device),
                       positions=slots, write_slots=slots, attn_mask=None, kv_len=context + 1,
                       query_rows=zero, query_cols=zero, offsets=[0])
