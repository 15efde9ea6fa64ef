"""Logits processors: what changes the target's logits before a token is chosen.

Penalties, `logit_bias` and grammar masks all change the distribution the target samples from.
For speculation to stay lossless, the verification pass must apply them at every position of a
draft tree exactly as plain decoding applies them at that position: a node's row is processed
with the completion as it would be if the path from the root to that node were accepted.

Usage:
    from eyas.engine.logits_process import process_tree_rows
    logits = process_tree_rows(row_logits, processors, output_ids, tree)  # [N+1, V]

A processor is any callable `(output_ids, logits) -> logits`:
- `output_ids`: the completion's token ids before the position (the prompt excluded; the
  root, the last emitted token, included), plus the draft path down to the node;
- `logits`: [V] float32, the position's logits; the processor may change them in place and
  returns the result. It must depend on nothing but these two arguments (and its own fixed
  configuration), so that the same position gives the same logits whichever way it is reached.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from eyas.engine.speculative.draft import DraftTree

LogitsProcessor = Callable[[Sequence[int], Tensor], Tensor]
RowRecompute = Callable[[int], Tensor]  # row index -> that row's raw logits [V], computed alone

NEAR_TIE = 1e-3  # logit gap under which a greedy row's argmax is settled on the row alone


def node_paths(tree: DraftTree) -> list[list[int]]:
    """Draft tokens from the root down to each node; index 0 is the root itself ([])."""
    tokens = tree.tokens.tolist()
    paths: list[list[int]] = [[]]
    for node, parent in enumerate(tree.parents.tolist(), start=1):
        paths.append(paths[parent] + [tokens[node - 1]])
    return paths


def process_tree_rows(logits: Tensor, processors: Sequence[LogitsProcessor],
                      output_ids: Sequence[int], tree: DraftTree,
                      recompute: RowRecompute | None = None) -> Tensor:
    """logits [N+1, V] of the root and the tree's nodes -> processed float32 logits [N+1, V].

    Row i is processed with `output_ids` followed by the path to node i. No processors: the
    logits come back unchanged (no copy).

    recompute (greedy rows only): a float32 matmul rounds a row differently with the number
    of rows it multiplies (~1e-5), and a processor can bring two logits that were far apart
    within that distance. A row whose processed top two logits end closer than NEAR_TIE is
    recomputed alone (as plain decoding computes it, one row at a time) and processed again,
    so that its argmax is plain decoding's."""
    if not processors:
        return logits
    logits = logits.float().clone()
    history = list(output_ids)
    for row, path in enumerate(node_paths(tree)):
        ids = history + path
        logits[row] = apply_processors(processors, ids, logits[row])
        if recompute is not None and near_tie(logits[row]):
            logits[row] = apply_processors(processors, ids, recompute(row).float().clone())
    return logits


def apply_processors(processors: Sequence[LogitsProcessor], output_ids: Sequence[int],
                     row: Tensor) -> Tensor:
    """One position: row [V] float32 through every processor in order."""
    for processor in processors:
        row = processor(output_ids, row)
    return row


def near_tie(row: Tensor) -> bool:
    """Whether the top two of row [V] are within NEAR_TIE (an argmax that rounding can flip)."""
    top = torch.topk(row, 2).values
    return bool(top[0] - top[1] < NEAR_TIE)
