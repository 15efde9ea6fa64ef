"""Tree attention: masks, positions and paths for root + draft nodes.

Row/column 0 is the root (the last emitted token); rows 1..N are the draft nodes. Each node
sees the whole context, its ancestors (root included) and itself; its position is the context
length + its depth.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from eyas.engine.speculative.draft import DraftTree


def node_depths(tree: DraftTree) -> list[int]:
    """Depth of each draft node (children of the root have depth 1)."""
    depths = [0]  # the root
    for parent in tree.parents.tolist():
        depths.append(depths[parent] + 1)
    return depths[1:]


def tree_mask(tree: DraftTree) -> Tensor:
    """[N+1, N+1] bool: row i may attend to column j (j is i or an ancestor of i). Built in
    NumPy: a row copy per node, where PyTorch's indexing ops cost ~10 us each after a pass."""
    size = tree.size + 1
    mask = np.zeros((size, size), dtype=bool)
    mask[0, 0] = True
    for node, parent in enumerate(tree.parents.tolist(), start=1):
        mask[node] = mask[parent]
        mask[node, node] = True
    return torch.from_numpy(mask)


def children_of(tree: DraftTree) -> dict[int, list[int]]:
    """node -> its children in the order given (siblings are tried in that order)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents.tolist(), start=1):
        children.setdefault(parent, []).append(node)
    return children
