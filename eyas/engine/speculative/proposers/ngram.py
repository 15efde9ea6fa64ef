"""`ngram`: prompt lookup. Find the last n tokens earlier in prompt + output; propose what
followed. n runs from `max_n` down to `min_n`; with `max_matches` > 1, several distinct
continuations of the longest matching n-gram become branches of a tree (shared prefixes merged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.errors import EyasError


@dataclass
class NgramConfig:
    max_n: int = 3
    min_n: int = 1
    max_matches: int = 1
    search_window: int = 4096  # only the last tokens are searched (keeps the cost bounded)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise EyasError(f"ngram sizes need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if self.max_matches < 1:
            raise EyasError("max_matches must be >= 1")


def find_continuations(tokens: list[int], n: int, length: int, max_matches: int) -> list[list[int]]:
    """Distinct continuations (most recent first) of earlier occurrences of the last n tokens."""
    if len(tokens) <= n:
        return []
    suffix = tokens[-n:]
    found: list[list[int]] = []
    # Scan right to left: recent context is the likeliest to repeat.
    for start in range(len(tokens) - n - 1, -1, -1):
        if tokens[start : start + n] == suffix:
            continuation = tokens[start + n : start + n + length]
            if continuation and continuation not in found:
                found.append(continuation)
                if len(found) >= max_matches:
                    break
    return found


def merge_into_tree(branches: list[list[int]], max_nodes: int) -> DraftTree:
    """A trie of the branches, nodes in insertion order (parents first), at most max_nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for branch in branches:
        node = 0
        for token in branch:
            key = (node, token)
            if key not in children:
                if len(tokens) >= max_nodes:
                    break
                tokens.append(token)
                parents.append(node)
                children[key] = len(tokens)
            node = children[key]
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


class NgramProposer:
    name = "ngram"
    tap_layers: tuple[int, ...] = ()

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()

    def begin(self, target, prompt_ids, params) -> None:
        pass

    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        if max_nodes <= 0:
            return DraftTree.empty()
        window = token_ids[-self.config.search_window :]
        for n in range(self.config.max_n, self.config.min_n - 1, -1):
            branches = find_continuations(window, n, max_nodes, self.config.max_matches)
            if branches:
                return merge_into_tree(branches, max_nodes)
        return DraftTree.empty()

    def observe(self, tree, result, output) -> None:
        pass
