"""Pruning a draft tree to what the logits processors allow (grammar masks).

A node whose token a grammar forbids after its parent's path has probability 0 under the
target's processed distribution: no acceptance rule can accept it, so it is dropped before
verification (with everything under it), and the pass verifies only nodes that can be accepted.

Usage:
    tree, node_map = prune_tree(tree, request.logits_processors, output_ids)
    proposer.renumber(node_map, tree.size)   # a proposer that keeps per-node statistics
"""

from __future__ import annotations

from typing import Sequence

import torch

from eyas.engine.logits_process import LogitsProcessor, node_paths
from eyas.engine.speculative.draft import DraftTree


def prune_tree(tree: DraftTree, processors: Sequence[LogitsProcessor], output_ids: Sequence[int]
               ) -> tuple[DraftTree, list[int]]:
    """Drop the draft nodes that a processor with an `accepts(ids, token)` method (a grammar)
    rejects after the path to their parent, and every node under them: such a node can never
    be accepted, so verifying it is wasted. Parents stay before children.

    Returns the pruned tree and, for each node i + 1 of `tree`, its id in the pruned tree
    (0: dropped). Nothing to drop: the same tree and the identity map."""
    checks = [p.accepts for p in processors if hasattr(p, "accepts")]
    identity = list(range(1, tree.size + 1))
    if not checks or not tree.size:
        return tree, identity
    history = list(output_ids)
    paths = node_paths(tree)
    tokens = tree.tokens.tolist()
    new_id = [0] * (tree.size + 1)  # new_id[0] = 0: the root stays the root
    kept: list[int] = []
    for node, parent in enumerate(tree.parents.tolist(), start=1):
        if parent and not new_id[parent]:
            continue  # under a dropped node
        prefix = history + paths[parent]
        if all(accepts(prefix, tokens[node - 1]) for accepts in checks):
            kept.append(node)
            new_id[node] = len(kept)
    if len(kept) == tree.size:
        return tree, identity
    index = torch.tensor([node - 1 for node in kept], dtype=torch.long)
    parents = torch.tensor([new_id[int(tree.parents[node - 1])] for node in kept], dtype=torch.long)
    probs = tree.draft_probs[index] if tree.draft_probs is not None else None
    return DraftTree(tree.tokens[index], parents, probs), new_id[1:]


def prune_draft(proposer, tree: DraftTree, processors: Sequence[LogitsProcessor],
                output_ids: Sequence[int], budget: int) -> DraftTree:
    """A proposer's tree pruned to what `processors` allow, then cut to `budget` nodes; a
    proposer that keeps per-node statistics (`renumber`) is told where its nodes went."""
    pruned, node_map = prune_tree(tree, processors, output_ids)
    if pruned is tree:
        return tree.truncated(budget)
    if hasattr(proposer, "renumber"):
        proposer.renumber([node if node <= budget else 0 for node in node_map], min(pruned.size, budget))
    return pruned.truncated(budget)
