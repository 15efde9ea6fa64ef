"""Pruning a draft tree to what the logits processors allow (grammar masks).

A node whose token a grammar forbids after its parent's path has probability 0 under the
target's processed distribution: no acceptance rule can accept it, so it is dropped before
verification (with everything under it), and the pass verifies only nodes that can be accepted.
Where the grammar forces the next tokens (one allowed token per position: `{"name": ` at the
start of an object, `, "age": ` between required properties), those tokens lead the tree: a
draft the target's processed distribution accepts for sure, so a step under a schema emits a
whole forced run plus one token, where plain decoding spends a step per token.

Usage:
    tree, node_map = prune_tree(tree, request.logits_processors, output_ids)
    proposer.renumber(node_map, tree.size)   # a proposer that keeps per-node statistics
"""

from __future__ import annotations

from typing import Sequence

import torch

from eyas.engine.logits_process import LogitsProcessor, node_paths
from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.tree import children_of


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


def lead_with_forced(tree: DraftTree, forced: Sequence[int], budget: int) -> tuple[DraftTree, list[int]]:
    """`tree` led by the chain of tokens a grammar forces next (the only token its mask
    allows at each of those positions, so the target's processed distribution accepts them
    for sure): the chain comes first, then the tree's nodes that grow below its end, within
    `budget`; the tree's nodes elsewhere are dropped (after pruning, every node above the
    chain's depth lies on it anyway). Returns the tree and each old node's new id (0: dropped)."""
    forced = list(forced[:budget])
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children = children_of(tree)
    on_chain = [0]  # the tree's node at each depth of the chain, while the tree follows it
    for token in forced:
        child = next((c for c in children.get(on_chain[-1], []) if tokens[c - 1] == token), None)
        if child is None:
            break
        on_chain.append(child)
    new_id = {node: depth for depth, node in enumerate(on_chain) if depth}
    new_tokens, new_parents = list(forced), list(range(len(forced)))
    if len(on_chain) == len(forced) + 1:  # the tree holds the whole chain: keep what grows below
        below = {on_chain[-1]: len(forced)}
        for node, parent in enumerate(parents, start=1):
            if parent in below and node not in new_id and len(new_tokens) < budget:
                new_tokens.append(tokens[node - 1])
                new_parents.append(below[parent])
                below[node] = new_id[node] = len(new_tokens)
    led = DraftTree(torch.tensor(new_tokens, dtype=torch.long), torch.tensor(new_parents, dtype=torch.long))
    return led, [new_id.get(node, 0) for node in range(1, tree.size + 1)]


def prune_draft(proposer, tree: DraftTree, processors: Sequence[LogitsProcessor],
                output_ids: Sequence[int], budget: int) -> DraftTree:
    """A proposer's tree pruned to what `processors` allow and led by the tokens a grammar
    forces next (`forced(output_ids)`: free drafts that are always accepted), cut to `budget`
    nodes; a proposer that keeps per-node statistics (`renumber`) is told where its nodes
    went."""
    pruned, node_map = prune_tree(tree, processors, output_ids)
    forced = next((p.forced(output_ids) for p in processors if hasattr(p, "forced")), [])
    if forced and budget > 0 and pruned.draft_probs is None:
        pruned, led_map = lead_with_forced(pruned, forced, budget)
        node_map = [led_map[node - 1] if node else 0 for node in node_map]
    if pruned is tree:
        return tree.truncated(budget)
    if hasattr(proposer, "renumber"):
        proposer.renumber([node if node <= budget else 0 for node in node_map], min(pruned.size, budget))
    return pruned.truncated(budget)
