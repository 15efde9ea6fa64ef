"""`PrefixCache`: finished requests' KV rows kept resident and reused by requests that start the
same way (multi-turn chat re-sends its history; the n samples of one prompt; a shared system
prompt).

Design, and why it fits the pool (kv_pool.py): the pool lends one contiguous row per request
and keeps held rows packed at the bottom, so that a decode pass covers rows [0, span). Paged
blocks would need a block table in every attention kernel; rows need none. So the unit of
caching is a row:

- When a request is released, its row stays resident as a *cached prefix*: the committed
  token ids of the row (prompt + output, as far as their keys and values are in the row) are
  indexed in a radix tree (radix.py). A failed request's row is not kept. A cached prefix that
  is a prefix of the new one is dropped (the new one holds it too); one already covered by a
  resident prefix is not kept.
- A new request is matched at admission against the cached prefixes (longest match in the
  tree) and against the prompts of running requests, as far as their prefill has been computed
  (`available`). The reused length is capped at prompt length - 1: the last prompt token is
  always computed, for the logits of the first output token.
- Reuse: the request takes the lowest row no request holds (held rows stay packed). If the
  match covers a whole cached prefix, the request *adopts* that row: its keys and values stay
  where they are (zero copy when the row is already the lowest unheld one, else one swap of
  rows), and the prefix leaves the cache (the request's own row will be cached again when it
  finishes, longer). Otherwise the matched slots are copied from the cached row, or from the
  running request's row, and the source stays.
- A request whose prompt shares more with a prompt still being prefilled than with anything
  computed waits in the queue (later requests may pass it) until that prefill has computed the
  shared part: the n samples of a prompt, sent together, prefill it once.
- Eviction, least recently used first, happens when a request needs the row a cached prefix
  occupies and no row is free. Cached prefixes live only in rows no request holds, so the
  cache never adds memory: its bound is the pool's (rows x slots), and a running request never
  waits for it. A match or a new entry makes a prefix the most recently used.
- Every decision here only updates bookkeeping and queues its copies on the pool; the loop
  thread applies them before the next step runs (the scheduler may run on a helper thread
  while a step computes). A copy from a running request is checked when it is applied: it
  reuses no more than that request has really computed by then (a failed prefill chunk leaves
  less), and the request's prefill starts from there.

Speculation stays lossless (verification is the target's own pass over the same keys and
values). A proposer that reads the target's taps (EAGLE-3) gets the taps of the reused prefix
from the row (the pool keeps them, `KVPool.keep_taps`), exactly as a prefill would have given
them; token-based proposers (n-grams, suffix, draft models, layer-skip) read token ids only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eyas.scheduler.kv_pool import KVPool
from eyas.scheduler.radix import RadixTree, common_prefix

if TYPE_CHECKING:
    from eyas.scheduler.request import Request


@dataclass(eq=False)
class CachedPrefix:
    tokens: list[int]  # token ids whose keys and values are in slots [0, len) of `row`
    row: int | None  # pool row (None once evicted)
    last_used: int = 0  # LRU clock

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class PrefixMatch:
    length: int = 0  # prompt tokens whose keys and values are reused
    entry: CachedPrefix | None = None  # ... from this cached prefix
    source: Request | None = None  # ... or from this running request's prompt
    wait: bool = False  # a prompt still prefilling will offer more: wait for it


@dataclass
class PrefixCacheStats:
    rows: int = 0  # cached prefixes resident
    tokens: int = 0  # their tokens
    evictions: int = 0  # prefixes evicted (least recently used first)
    queries: int = 0  # prompt tokens looked up (admitted requests)
    hits: int = 0  # of those, tokens whose keys and values were reused


class PrefixCache:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.tree = RadixTree()
        self.clock = itertools.count(1)
        self.evictions = 0
        self.queries = 0
        self.hits = 0

    # ---- admission ----------------------------------------------------------------------
    def match(self, request: Request, running: list[Request],
              available: dict[Request, int]) -> PrefixMatch:
        """The longest reusable prefix of the request's prompt. `available`: per running
        request, the prompt tokens its prefill will have computed when the next step starts."""
        prompt = request.prompt_ids
        limit = len(prompt) - 1
        if getattr(request.params, "prompt_logprobs", None) is not None:
            limit = 0  # `echo` with logprobs reads logits at every prompt position: computes all
        best = PrefixMatch()
        if limit < 1:
            return best
        length, entries = self.tree.longest_match(prompt)
        length = min(length, limit)
        if length > 0:
            # prefer a prefix the match covers whole (it can be adopted), then the most recent
            entry = max(entries, key=lambda e: (e.length == length, e.last_used))
            best = PrefixMatch(length, entry=entry)
        promised = 0
        for other in running:
            if other.done or other is request:
                continue
            shared = common_prefix(prompt, other.prompt_ids, limit)
            ready = min(shared, available.get(other, 0))
            if ready > best.length:
                best = PrefixMatch(ready, source=other)
            promised = max(promised, shared)
        best.wait = promised > best.length
        return best

    def admit(self, request: Request, match: PrefixMatch) -> int:
        """Give the request the lowest row no request holds, set up to reuse `match`; returns
        the row. The copies are queued on the pool."""
        pool = self.pool
        target = pool.lowest_unheld()
        length, entry, source = match.length, match.entry, match.source
        self.queries += request.prompt_len
        source_row = target
        if entry is not None and length > 0:
            entry.last_used = next(self.clock)
            adopt = length == entry.length or (entry.row == target and pool.free_row() is None)
            if adopt:  # the request takes the prefix's row: its slots stay (zero copy)
                old_row = entry.row
                self._forget(entry)
                if old_row != target:  # bring them to the lowest unheld row (one swap)
                    self._swap_into(target, old_row, entry.length)
            else:  # copy the matched slots; the prefix stays cached (moved off `target`)
                self._clear(target, keep=entry)
                source_row = entry.row
        else:
            self._clear(target)
            if source is not None and length > 0:
                source_row = source.row
        pool.owners[target] = request
        request.prefix_length = length

        def reuse() -> None:  # applied on the loop thread, before the request's first chunk
            valid = length if source is None else min(length, source.context_length)
            pool.copy_now(source_row, target, valid)
            request.context_length = max(request.context_length, valid)
            request.prefix_hit = valid
            self.hits += valid

        pool.queue(reuse)
        return target

    # ---- release --------------------------------------------------------------------------
    def retain(self, request: Request) -> bool:
        """Keep a released request's row as a cached prefix; False when it is not kept (the
        caller frees the row)."""
        length = min(request.context_length, len(request.token_ids))
        if request.failure is not None or length < 1 or request.row is None:
            return False
        tokens = request.token_ids[:length]
        covered, holders = self.tree.longest_match(tokens)
        if covered == length and holders:  # resident already (as this or a longer prefix)
            max(holders, key=lambda e: e.last_used).last_used = next(self.clock)
            return False
        for shorter in self.tree.prefixes_of(tokens):  # this row holds them too
            self._forget(shorter)
        row = request.row
        entry = CachedPrefix(tokens, row, next(self.clock))
        self.pool.owners[row] = None
        self.pool.cached[row] = entry
        self.tree.insert(tokens, entry)
        return True

    def clear(self) -> None:
        """Drop every cached prefix; the rows they held become free."""
        for entry in [entry for entry in self.pool.cached if entry is not None]:
            self._forget(entry)
        self.tree = RadixTree()

    def stats(self) -> PrefixCacheStats:
        resident = [entry for entry in self.pool.cached if entry is not None]
        return PrefixCacheStats(len(resident), sum(entry.length for entry in resident),
                                self.evictions, self.queries, self.hits)

    # ---- rows -----------------------------------------------------------------------------
    def _forget(self, entry: CachedPrefix) -> None:
        """Drop a prefix from the index and its row (the row's slots are left as they are)."""
        self.tree.remove(entry.tokens, entry)
        if entry.row is not None and self.pool.cached[entry.row] is entry:
            self.pool.cached[entry.row] = None
        entry.row = None

    def _clear(self, row: int, keep: CachedPrefix | None = None) -> None:
        """Make `row` hold no cached prefix: move its prefix to a free row (evicting the least
        recently used prefix, other than `keep`, when none is free); a prefix that cannot move
        is evicted."""
        pool = self.pool
        resident = pool.cached[row]
        if resident is None:
            return
        free = pool.free_row()
        if free is None:
            victim = min((e for e in pool.cached if e is not None and e is not keep),
                         key=lambda e: e.last_used, default=None)
            if victim is None or victim is resident:
                self._forget(resident)
                self.evictions += 1
                return
            free = victim.row
            self._forget(victim)
            self.evictions += 1
        length = resident.length
        pool.queue(lambda: pool.copy_now(row, free, length))
        pool.cached[row], pool.cached[free] = None, resident
        resident.row = free

    def _swap_into(self, target: int, source: int, length: int) -> None:
        """Bring `length` slots of row source (no longer cached) to row target; whatever
        prefix target held moves to source."""
        pool = self.pool
        resident = pool.cached[target]
        swap_length = max(length, resident.length if resident is not None else 0)
        pool.queue(lambda: pool.swap_now(target, source, swap_length))
        pool.cached[target], pool.cached[source] = None, resident
        if resident is not None:
            resident.row = source
