"""The global store of `--draft suffix`: earlier requests' outputs in one suffix trie, least
recently used first out, bounded in memory.

Each finished request adds one document: the last prompt tokens before its output (so that
the first tokens of an answer can be matched too) followed by the output. The documents are
kept in an LRU order; a document equal to one already stored refreshes it instead of being
counted twice. When the trie's estimated size passes `max_bytes`, the least recently used
documents are removed (their counts taken out of the trie) until it fits again.

Thread-safety: the serving engine's requests share one store; every read and write holds the
store's lock. A request's output only ever changes what is proposed to another request, never
its tokens (verification is lossless).

Usage:
    store = SuffixStore(max_bytes=64 << 20, max_depth=24)
    store.add(prompt_ids[-8:] + output_ids)
    with store.lock:
        node, length = store.trie.match(context, max_length=8)
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from eyas.engine.speculative.proposers.suffix_trie import new_trie


class SuffixStore:
    def __init__(self, max_bytes: int, max_depth: int = 24) -> None:
        if max_bytes < 0:
            raise ValueError(f"the suffix store's size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.trie = new_trie(max_depth)
        self.lock = threading.Lock()
        self.documents: OrderedDict[tuple[int, ...], None] = OrderedDict()  # LRU first
        self.token_count = 0  # tokens of the stored documents
        self.evictions = 0
        self.lookups = 0  # proposals that consulted the store
        self.hits = 0  # ... and found a continuation there

    @property
    def approximate_bytes(self) -> int:
        """The trie's nodes plus the documents kept for eviction (one pointer per token)."""
        return self.trie.approximate_bytes + 8 * self.token_count

    def add(self, tokens: list[int]) -> None:
        """Store one document (or refresh an equal one); evict down to the memory bound."""
        key = tuple(tokens)
        if not key:
            return
        with self.lock:
            if key in self.documents:
                self.documents.move_to_end(key)
                return
            if self._bytes_of(len(key)) > self.max_bytes:
                return  # could never fit
            self.documents[key] = None
            self.trie.insert(list(key))
            self.token_count += len(key)
            while self.approximate_bytes > self.max_bytes and len(self.documents) > 1:
                oldest, _ = self.documents.popitem(last=False)
                self.trie.remove(list(oldest))
                self.token_count -= len(oldest)
                self.evictions += 1

    def _bytes_of(self, tokens: int) -> int:
        """The most one document of `tokens` tokens can add."""
        return (1 + tokens * self.trie.max_depth) * self.trie.node_bytes + 8 * tokens

    def record_lookup(self, hit: bool) -> None:
        with self.lock:
            self.lookups += 1
            self.hits += int(hit)

    def clear(self) -> None:
        with self.lock:
            self.trie = new_trie(self.trie.max_depth)
            self.documents.clear()
            self.token_count = 0

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"documents": len(self.documents), "tokens": self.token_count,
                    "nodes": self.trie.nodes, "bytes": self.approximate_bytes,
                    "max_bytes": self.max_bytes, "evictions": self.evictions,
                    "lookups": self.lookups, "hits": self.hits}
