"""A suffix trie bounded by depth, with occurrence counts: the structure behind `--draft suffix`.

Every substring of at most `max_depth` tokens of the inserted sequences is a path from the
root; a node's count is how many times its string occurs (as (sequence, start) pairs). So
the count of a child over the count of its parent is how often that string was followed by
the child's token: the frequency that ranks suffix-decoding continuations.

A sequence is appended one token at a time (`Appender`): each new token extends the paths of
the last `max_depth - 1` start positions, O(max_depth) operations. A whole sequence can be
taken out again (`remove`): its counts are decremented and nodes left at count 0 are freed,
which is how the global store evicts a request's output.

Layout (flat, for Python's sake: a node costs a dict entry and four list slots, no object):
edges maps node * STRIDE + token -> child; each node keeps its token, its count, its first
child and its next sibling (-1: none), so a node's children are a linked list.

Two implementations, the same answers (node ids, children's order, ties; tested): the native
one in the C++ extension (csrc/suffix_trie.cpp), which `new_trie` returns wherever the
extension loads, and this module's `SuffixTrie`, which it returns elsewhere
(EYAS_SUFFIX_NATIVE=0 asks for it). Appending is the cost that shows: serving 16 requests,
every row appends each token it emits to its own trie, ~7 us a token at depth 24 in Python
and ~1 us native (600-token sequences, a quiet loop; more between passes, caches cold).

Usage:
    trie = new_trie(max_depth=4)
    trie.insert([1, 2, 3, 1, 2, 4])
    node, length = trie.match([9, 1, 2], max_length=3)   # the node of [1, 2], 2
    dict(trie.children(node))                            # {3: node of [1,2,3], 4: ...}
"""

from __future__ import annotations

import heapq
import os
from typing import Iterator, Sequence

STRIDE = 1 << 22  # > any vocabulary: an edge's key is node * STRIDE + token
NODE_BYTES = 160  # measured (tracemalloc, tests): an edge entry, four list slots, their ints
NATIVE_NODE_BYTES = 64  # the native trie's hash node (32), bucket (8), four int32 slots (16), slack

# (token, index of the parent in the list (-1: a child of the matched node), depth,
#  probability of lying on the accepted path, count ratio to the parent)
Continuation = tuple[int, int, int, float, float]


def new_trie(max_depth: int = 24):
    """A native trie where the extension loads (and EYAS_SUFFIX_NATIVE is not 0), else the
    Python one: the same interface and answers."""
    native = _native_module()
    return NativeSuffixTrie(max_depth, native) if native is not None else SuffixTrie(max_depth)


def _native_module():
    if os.environ.get("EYAS_SUFFIX_NATIVE", "1").strip() == "0":
        return None
    from eyas.models.extension import enabled, module

    return module() if enabled() else None


class SuffixTrie:
    node_bytes = NODE_BYTES

    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 2:
            raise ValueError(f"a suffix trie needs max_depth >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.edges: dict[int, int] = {}  # node * STRIDE + token -> child; node 0 = the root
        self.tokens: list[int] = [-1]
        self.counts: list[int] = [0]
        self.first_child: list[int] = [-1]
        self.next_sibling: list[int] = [-1]
        self.free: list[int] = []  # ids of removed nodes, reused
        self.nodes = 0  # live nodes, root excluded

    @property
    def approximate_bytes(self) -> int:
        return (self.nodes + 1) * NODE_BYTES

    def count(self, node: int) -> int:
        return self.counts[node]

    def child(self, node: int, token: int) -> int:
        """The child of `node` for `token`; -1 when there is none."""
        return self.edges.get(node * STRIDE + token, -1)

    def children(self, node: int) -> Iterator[tuple[int, int]]:
        """(token, child) of every child of `node`."""
        child = self.first_child[node]
        while child >= 0:
            yield self.tokens[child], child
            child = self.next_sibling[child]

    def appender(self) -> Appender:
        return Appender(self)

    def insert(self, tokens: list[int]) -> None:
        appender = self.appender()
        for token in tokens:
            appender.append(token)

    def remove(self, tokens: list[int]) -> None:
        """Take out one earlier `insert(tokens)`: every path it added loses one count."""
        for start in range(len(tokens)):
            node = 0
            for token in tokens[start : start + self.max_depth]:
                child = self.edges.get(node * STRIDE + token, -1)
                assert child >= 0, "removing a sequence that was not inserted"
                self.counts[child] -= 1
                if self.counts[child] == 0:  # its whole subtree is at 0 too: drop it
                    self._unlink(node, child)
                    self._release(node, child)
                    break
                node = child

    def _unlink(self, parent: int, child: int) -> None:
        if self.first_child[parent] == child:
            self.first_child[parent] = self.next_sibling[child]
            return
        previous = self.first_child[parent]
        while self.next_sibling[previous] != child:
            previous = self.next_sibling[previous]
        self.next_sibling[previous] = self.next_sibling[child]

    def _release(self, parent: int, node: int) -> None:
        """Free `node` (already unlinked from `parent`) and its subtree."""
        stack = [(parent, node)]
        while stack:
            parent, current = stack.pop()
            stack.extend((current, child) for _, child in self.children(current))
            del self.edges[parent * STRIDE + self.tokens[current]]
            self.first_child[current] = -1
            self.free.append(current)
            self.nodes -= 1

    def match(self, context: list[int], max_length: int, min_count: int = 1) -> tuple[int, int]:
        """(node, length) of the longest suffix of `context`, at most `max_length` tokens, that
        occurs in the trie at least `min_count` times; (0, 0) when none does."""
        edges, counts = self.edges, self.counts
        for length in range(min(max_length, len(context), self.max_depth - 1), 0, -1):
            node = 0
            for token in context[len(context) - length :]:
                node = edges.get(node * STRIDE + token, -1)
                if node < 0:
                    break
            if node > 0 and counts[node] >= min_count:
                return node, length
        return 0, 0

    def continuations(self, node: int, denominator: int, scales: Sequence[float], limit: int,
                      max_children: int, min_probability: float) -> list[Continuation]:
        """At most `limit` continuations under `node`, best first (parents before children),
        grown from a heap: each node's `max_children` most frequent children (ties: the
        newer), a child's probability its parent's x count / `denominator` (the parent's count;
        for the children of `node`, what the caller says) x scales[the parent's depth], kept
        when >= `min_probability`. suffix_candidates.grow says what they are for."""
        found: list[Continuation] = []
        heap: list[tuple[float, int, int, int, int, float]] = []
        tiebreak = 0
        counts, first_child, next_sibling, tokens = self.counts, self.first_child, self.next_sibling, self.tokens

        def push(trie_node: int, parent: int, depth: int, probability: float, below: int) -> None:
            nonlocal tiebreak
            if below <= 0:
                return
            top = []  # children in the trie's order (newest first)
            child = first_child[trie_node]
            while child >= 0:
                top.append(child)
                child = next_sibling[child]
            if len(top) > max_children:
                top = heapq.nlargest(max_children, top, key=counts.__getitem__)
            scale = scales[depth]
            for child in top:
                ratio = counts[child] / below
                value = probability * ratio * scale
                if value >= min_probability:
                    tiebreak += 1
                    heapq.heappush(heap, (-value, tiebreak, child, parent, depth + 1, ratio))

        push(node, -1, 0, 1.0, denominator)
        while heap and len(found) < limit:
            negative, _, child, parent, depth, ratio = heapq.heappop(heap)
            found.append((tokens[child], parent, depth, -negative, ratio))
            push(child, len(found) - 1, depth, -negative, counts[child])
        return found


class NativeSuffixTrie:
    """The extension's trie (csrc/suffix_trie.cpp) behind SuffixTrie's interface; its methods
    are the native ones, bound once."""

    node_bytes = NATIVE_NODE_BYTES

    def __init__(self, max_depth: int, native) -> None:
        self._native = native
        self._trie = trie = native.SuffixTrie(max_depth)
        self.max_depth = max_depth
        self.count, self.child, self.children = trie.count, trie.child, trie.children
        self.insert, self.remove, self.continuations = trie.insert, trie.remove, trie.continuations

    @property
    def nodes(self) -> int:
        return self._trie.nodes

    @property
    def approximate_bytes(self) -> int:
        """Linear in the nodes, as the Python trie's: what the containers hold now
        (`container_bytes`) also keeps what they reserved, which removing nodes never gives
        back, so a store bounded by it would evict everything once it had grown."""
        return (self._trie.nodes + 1) * NATIVE_NODE_BYTES

    def container_bytes(self) -> int:
        return self._trie.bytes()

    def appender(self):
        return self._native.SuffixAppender(self._trie)

    def match(self, context: Sequence[int], max_length: int, min_count: int = 1) -> tuple[int, int]:
        """SuffixTrie.match; only the last max_length tokens cross into C++."""
        if max_length <= 0:
            return 0, 0
        return self._trie.match(list(context[-max_length:]), max_length, min_count)


class Appender:
    """Appends tokens to one sequence of a trie: keeps the nodes of the sequence's last
    max_depth - 1 suffixes, so that each token costs O(max_depth)."""

    def __init__(self, trie: SuffixTrie) -> None:
        self.trie = trie
        self.active: list[int] = []  # nodes of the current suffixes, longest first

    def append(self, token: int) -> None:
        trie = self.trie
        edges, counts, first, sibling = trie.edges, trie.counts, trie.first_child, trie.next_sibling
        grown = []
        for node in self.active + [0]:  # the hot loop: kept flat
            key = node * STRIDE + token
            child = edges.get(key, -1)
            if child < 0:
                if trie.free:
                    child = trie.free.pop()
                    trie.tokens[child], counts[child], first[child] = token, 0, -1
                    sibling[child] = first[node]
                else:
                    child = len(counts)
                    trie.tokens.append(token)
                    counts.append(0)
                    first.append(-1)
                    sibling.append(first[node])
                first[node] = child
                edges[key] = child
                trie.nodes += 1
            counts[child] += 1
            grown.append(child)
        self.active = grown[1:] if len(grown) >= trie.max_depth else grown

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def longest(self, max_length: int, min_count: int = 1) -> tuple[int, int]:
        """`trie.match(sequence, max_length, min_count)` for the sequence appended so far, read
        from the kept suffix nodes instead of walking each suffix from the root (up to ~80
        lookups; the serving engine asks every row at every step). Valid while nothing is
        removed from the trie (a request's own trie)."""
        active, counts = self.active, self.trie.counts
        for length in range(min(max_length, len(active)), 0, -1):
            node = active[len(active) - length]
            if counts[node] >= min_count:
                return node, length
        return 0, 0
