"""`RadixTree`: token sequences indexed by prefix, for the prefix cache (prefix_cache.py).

Each inserted sequence is an *entry* (any object); edges hold runs of token ids and split where
two sequences part. Every node knows the entries of its subtree, so the longest match of a
query is one walk from the root:

    tree = RadixTree()
    tree.insert([1, 2, 3, 4], "a")
    tree.insert([1, 2, 9], "b")
    tree.longest_match([1, 2, 3, 7])  # (3, {"a"}): 3 tokens match, and "a" holds them
    tree.longest_match([1, 2, 5])     # (2, {"a", "b"})
    tree.prefixes_of([1, 2, 3, 4, 5])  # ["a"]: entries that are whole prefixes of the query
    tree.remove([1, 2, 3, 4], "a")

Comparisons run on list slices (C speed), so a walk costs one slice compare per edge.
"""

from __future__ import annotations

from typing import Any, Sequence


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of a and b (at most `limit`)."""
    n = min(len(a), len(b))
    if limit is not None:
        n = min(n, limit)
    if n <= 0:
        return 0
    if a[:n] == b[:n]:
        return n
    low, high = 0, n - 1  # the answer is in [low, high]
    while low < high:  # binary search on slice equality
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class _Node:
    __slots__ = ("edge", "children", "entries", "ends")

    def __init__(self, edge: list[int]) -> None:
        self.edge = edge  # tokens on the edge into this node
        self.children: dict[int, _Node] = {}  # by the first token of the child's edge
        self.entries: set[Any] = set()  # entries whose sequence runs through this node
        self.ends: set[Any] = set()  # entries whose sequence ends exactly here


class RadixTree:
    def __init__(self) -> None:
        self.root = _Node([])
        self.size = 0  # entries held

    def insert(self, tokens: Sequence[int], entry: Any) -> None:
        """Index `entry` under `tokens` (non-empty)."""
        assert tokens, "an empty sequence cannot be indexed"
        tokens = list(tokens)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(tokens[i:])
                node.children[tokens[i]] = child
                child.entries.add(entry)
                child.ends.add(entry)
                self.size += 1
                return
            shared = common_prefix(child.edge, tokens[i:])
            if shared < len(child.edge):  # split the edge where the sequences part
                middle = _Node(child.edge[:shared])
                middle.entries = set(child.entries)
                child.edge = child.edge[shared:]
                middle.children[child.edge[0]] = child
                node.children[tokens[i]] = middle
                child = middle
            child.entries.add(entry)
            node, i = child, i + shared
        node.ends.add(entry)
        self.size += 1

    def remove(self, tokens: Sequence[int], entry: Any) -> None:
        """Forget `entry` (indexed under `tokens`); nodes left without entries go."""
        node, i = self.root, 0
        path: list[_Node] = []
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or entry not in child.entries:
                raise KeyError("entry not indexed under these tokens")
            path.append(child)
            node, i = child, i + len(child.edge)
        node.ends.discard(entry)
        parent = self.root
        for child in path:
            child.entries.discard(entry)
            if not child.entries:
                del parent.children[child.edge[0]]
                break  # its whole subtree held only this entry
            parent = child
        self.size -= 1

    def longest_match(self, tokens: Sequence[int]) -> tuple[int, set[Any]]:
        """(length, entries): the longest prefix of `tokens` that some entry starts with, and
        every entry that starts with it ((0, empty) when none shares a first token)."""
        tokens = list(tokens)
        node, i = self.root, 0
        length, entries = 0, set()
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            shared = common_prefix(child.edge, tokens[i:])
            length, entries = i + shared, child.entries
            if shared < len(child.edge):
                break
            node, i = child, i + shared
        return length, set(entries)

    def prefixes_of(self, tokens: Sequence[int]) -> list[Any]:
        """Entries whose whole sequence is a prefix of `tokens` (the query itself included)."""
        tokens = list(tokens)
        node, i, found = self.root, 0, []
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or tokens[i : i + len(child.edge)] != child.edge:
                break
            node, i = child, i + len(child.edge)
            found.extend(node.ends)
        return found
