"""`X+ngram`: a proposer's draft tree with the prompt-lookup continuation grafted onto it.

Why: a trained head and prompt lookup are right in different places. The head predicts prose
it has seen the like of; prompt lookup predicts text that repeats the prompt or the answer so
far (names, code, lists), often several tokens at once and at no drafting cost. One
verification pass can check both: the n-gram continuation becomes one more branch of the
tree, sharing the nodes where both agree, so a step accepts whichever branch was right.

How: the main proposer drafts its tree first, with the step's budget; the n-gram branch (at
most `graft_tokens` tokens, only where an n-gram of at least `min_n` tokens matched) is then
merged in as a trie. The n-gram nodes come after the main tree's nodes, so the budget cuts
them first. Only the main proposer sees its statistics: it is told how its nodes were
renumbered (`renumber`), and a node it did not draft has rank 0 for it.

Usage:
    eyas generate --draft eagle3:smollm2-135m+ngram            # n-gram 3..2, 4 tokens
    eyas generate --draft "eagle3:smollm2-135m+ngram:3,1,4"    # MAX_N, MIN_N, GRAFT_TOKENS
"""

from __future__ import annotations

import copy

import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.proposers.ngram import find_continuations
from eyas.errors import EyasError


class NgramGraftProposer:
    def __init__(self, main, max_n: int = 3, min_n: int = 2, graft_tokens: int = 4,
                 search_window: int = 4096) -> None:
        if not hasattr(main, "renumber"):
            raise EyasError(f"'+ngram' grafts onto a tree-drafting method that keeps its own "
                            f"statistics (eagle3); '{main.name}' cannot take it")
        if not 1 <= min_n <= max_n or graft_tokens < 1:
            raise EyasError("+ngram:MAX_N,MIN_N,GRAFT_TOKENS needs 1 <= MIN_N <= MAX_N and "
                            f"GRAFT_TOKENS >= 1, got {max_n},{min_n},{graft_tokens}")
        self.main = main
        self.max_n, self.min_n, self.graft_tokens = max_n, min_n, graft_tokens
        self.search_window = search_window
        self.name = f"{main.name}+ngram"
        self.tap_layers = tuple(main.tap_layers)
        self.grafted = 0  # n-gram nodes added to the main trees (statistics)

    def __copy__(self) -> NgramGraftProposer:
        twin = object.__new__(NgramGraftProposer)
        twin.__dict__.update(self.__dict__)
        twin.main = copy.copy(self.main)  # per-request state lives in the main proposer
        twin.grafted = 0
        return twin

    def begin(self, target, prompt_ids, params) -> None:
        self.main.begin(target, prompt_ids, params)
        self.grafted = 0

    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        tree = self.main.propose(token_ids, max_nodes).truncated(max(max_nodes, 0))
        if tree.draft_probs is not None:  # a sampled chain: its probabilities cover it alone
            return tree
        branch = self._continuation(token_ids)
        merged, node_map = graft_branch(tree, branch, max_nodes)
        self.grafted += merged.size - tree.size
        self.main.renumber(node_map, merged.size)
        return merged

    def _continuation(self, token_ids: list[int]) -> list[int]:
        window = token_ids[-self.search_window :]
        for n in range(self.max_n, self.min_n - 1, -1):
            found = find_continuations(window, n, self.graft_tokens, max_matches=1)
            if found:
                return found[0]
        return []

    def observe(self, tree, result, output) -> None:
        self.main.observe(tree, result, output)

    def stats(self) -> dict:
        stats = self.main.stats() if hasattr(self.main, "stats") else {}
        return {**stats, "ngram_grafted_nodes": self.grafted}


def graft_branch(tree: DraftTree, branch: list[int], max_nodes: int
                 ) -> tuple[DraftTree, list[int]]:
    """`tree` with the chain `branch` (under the root) merged in, at most `max_nodes` nodes.

    Returns the merged tree and, for each node of `tree`, its node id in the merged tree (the
    same id: the tree's nodes keep their order and come first).
    """
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    node_map = list(range(1, len(tokens) + 1))
    child = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens), 1)}
    node = 0
    for token in branch:
        if (node, token) in child:
            node = child[(node, token)]
            continue
        if len(tokens) >= max_nodes:
            break
        tokens.append(token)
        parents.append(node)
        node = child[(node, token)] = len(tokens)
    if len(tokens) == tree.size:
        return tree, node_map
    return (DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)),
            node_map)
