"""`KVPool`: one shared KVCache [L, R, KV, S, D] whose rows are lent to running requests.

- A request holds one row from admission to finish; its slots [0, context_length) hold its
  committed tokens, the slots after them are scratch for the step's root, drafts and padding.
- A row no request holds is free, or *cached*: with prefix caching (prefix_cache.py) a finished
  request's row stays resident with its committed tokens, for later requests that start the
  same way. `owners[row]` is the running request, `cached[row]` the cached prefix; a request
  may take any row that no request holds (its cached prefix is moved or evicted first).
- Held rows stay packed at the bottom: when requests leave, the highest held rows are moved
  into the holes (a copy of their committed slots; a cached prefix in the hole swaps places
  with them). A decode pass then covers rows [0, span) with no free or cached row inside.
- With `keep_taps` (prefix caching beside a proposer that reads the target's taps, EAGLE-3)
  the pool also keeps each slot's taps [R, S, W], moved with the keys and values, so that a
  request that reuses a cached prefix hands its proposer the taps of the prefix it skipped.
- S starts small and doubles when a row needs more (up to `max_slots`), so memory follows the
  longest live request rather than the worst case. Cached prefixes never grow it.
- Rows and slots change only between steps. Decisions about rows (the scheduler's, which may
  run on a helper thread while a step computes) only *queue* their copies (`queue`); the loop
  thread applies them in order (`apply_pending`) when nothing is in flight: before a step
  runs, and when finished requests are released. Each queued copy names the rows as they were
  when it was decided; applying the queue in order keeps that true.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import Tensor

from eyas.engine.target import Target
from eyas.models.kv_cache import KVCache
from eyas.utils.huge_pages import zeros_on_huge_pages


def grown_slots(needed: int, start: int) -> int:
    """S of a pool that had `start` slots a row and doubled until `needed` fit."""
    size = max(start, 1)
    while size < needed:
        size *= 2
    return size


class KVPool:
    def __init__(self, target: Target, rows: int, max_slots: int, initial_slots: int = 256) -> None:
        config = target.config
        self.max_slots = max_slots
        self.cache = KVCache(config.num_hidden_layers, rows, config.num_key_value_heads,
                             min(initial_slots, max_slots), config.head_dim, dtype=target.kv_dtype,
                             device=target.device)
        self.owners: list[object | None] = [None] * rows  # request holding each row
        self.cached: list[Any | None] = [None] * rows  # cached prefix resident in each row
        self.keep_taps = False  # set by the engine (prefix caching + a proposer reading taps)
        self.taps: Tensor | None = None  # [R, S, W] taps of each slot, allocated on first write
        self.pending: list[Callable[[], None]] = []  # queued row copies (see the docstring)
        self._views: dict[tuple[int, int], KVCache] = {}  # `view`'s, until the cache grows

    @property
    def rows(self) -> int:
        return len(self.owners)

    @property
    def slots(self) -> int:
        return self.cache.max_slots

    @property
    def num_free(self) -> int:
        """Rows no request holds (free or holding a cached prefix): what admission may take."""
        return self.owners.count(None)

    def bytes_per_slot(self) -> int:
        keys = self.cache.keys
        per_row_slot = keys.shape[0] * keys.shape[2] * keys.shape[4] * keys.element_size()
        taps = self.taps.shape[2] * self.taps.element_size() if self.taps is not None else 0
        return (2 * per_row_slot + taps) * keys.shape[1]  # keys + values (+ taps), every row

    def lowest_unheld(self) -> int:
        return self.owners.index(None)

    def free_row(self) -> int | None:
        """The lowest row that no request holds and no cached prefix occupies."""
        for row, (owner, cached) in enumerate(zip(self.owners, self.cached)):
            if owner is None and cached is None:
                return row
        return None

    def allocate(self, owner: object) -> int:
        """The lowest row no request holds (keeps held rows packed); it must hold no cached
        prefix (the prefix cache moves or evicts it first)."""
        row = self.lowest_unheld()
        assert self.cached[row] is None, "a cached prefix is still resident in this row"
        self.owners[row] = owner
        return row

    def free(self, row: int) -> None:
        self.owners[row] = None

    def compact(self) -> list[tuple[object, int, int]]:
        """Move the highest held rows into the lowest unheld ones until the held rows are
        packed; a cached prefix in such a hole moves to the row left behind. Returns (owner,
        old row, new row) per move; the caller copies each owner's committed slots with
        `move_row` and updates its row."""
        moves = []
        while True:
            held = [r for r, owner in enumerate(self.owners) if owner is not None]
            unheld = [r for r, owner in enumerate(self.owners) if owner is None]
            if not held or not unheld or unheld[0] > held[-1]:
                return moves
            source, target = held[-1], unheld[0]
            owner = self.owners[source]
            self.owners[target], self.owners[source] = owner, None
            resident = self.cached[target]
            self.cached[target], self.cached[source] = None, resident
            if resident is not None:
                resident.row = source
            moves.append((owner, source, target))

    def move_row(self, source: int, target: int, length: int) -> None:
        """After `compact`: bring a held row's `length` committed slots from source to target
        (and the cached prefix that compact moved to source, the other way)."""
        resident = self.cached[source]
        if resident is not None:
            swap_length = max(length, resident.length)
            self.queue(lambda: self.swap_now(source, target, swap_length))
        elif length > 0:
            self.queue(lambda: self.copy_now(source, target, length))
        self.apply_pending()

    # ---- queued copies (see the module docstring) -----------------------------------
    def queue(self, operation: Callable[[], None]) -> None:
        self.pending.append(operation)

    @torch.inference_mode()
    def apply_pending(self) -> None:
        """Run the queued copies in order. Loop thread only, with no step in flight."""
        while self.pending:
            self.pending.pop(0)()

    def copy_now(self, source: int, target: int, length: int) -> None:
        """Slots [0, length) of row source onto row target (keys, values, taps)."""
        if length <= 0 or source == target:
            return
        self.cache.copy_row(source, target, length)
        if self.taps is not None:
            self.taps[target, :length] = self.taps[source, :length]

    def swap_now(self, a: int, b: int, length: int) -> None:
        """Exchange slots [0, length) of rows a and b: three slice copies per tensor (an
        advanced-index swap, gather then scatter of both rows, cost ~3.5x as much)."""
        if length <= 0 or a == b:
            return
        for tensor in (self.cache.keys, self.cache.values):  # [L, R, KV, S, D]
            _swap(tensor[:, a, :, :length], tensor[:, b, :, :length])
        if self.taps is not None:  # [R, S, W]
            _swap(self.taps[a, :length], self.taps[b, :length])

    # ---- taps kept for cached prefixes -------------------------------------------------
    def write_taps(self, row: int, start: int, taps: Tensor) -> None:
        """taps [T, W] of the tokens at slots start.. of a row (keep_taps only)."""
        if self.taps is None:
            with torch.inference_mode(False):
                self.taps = torch.zeros(self.rows, self.slots, taps.shape[-1], dtype=taps.dtype,
                                        device=taps.device)
        self.taps[row, start : start + taps.shape[0]] = taps

    def read_taps(self, row: int, length: int) -> Tensor | None:
        """A copy of the taps of slots [0, length) of a row: [1, length, W] (None: none kept)."""
        if self.taps is None or length <= 0:
            return None
        return self.taps[row : row + 1, :length].clone()

    def reset(self) -> None:
        """Every row free, nothing cached, nothing queued (after a failure of the loop)."""
        self.owners = [None] * self.rows
        for resident in self.cached:
            if resident is not None:
                resident.row = None
        self.cached = [None] * self.rows
        self.pending.clear()

    def ensure_slots(self, needed: int) -> None:
        """Grow S (doubling) so that slots [0, needed) exist in every row."""
        if needed <= self.cache.max_slots:
            return
        if needed > self.max_slots:
            raise IndexError(f"KV pool overflow: {needed} slots needed, at most {self.max_slots}")
        size = min(grown_slots(needed, self.cache.max_slots), self.max_slots)
        old = self.cache
        shape = list(old.keys.shape)
        shape[3] = size
        with torch.inference_mode(False):  # plain tensors, writable in and out of inference mode
            keys = zeros_on_huge_pages(shape, old.keys.dtype, old.keys.device)
            values = zeros_on_huge_pages(shape, old.values.dtype, old.values.device)
            keys[:, :, :, : old.max_slots] = old.keys
            values[:, :, :, : old.max_slots] = old.values
            if self.taps is not None:
                taps = self.taps.new_zeros(self.rows, size, self.taps.shape[2])
                taps[:, : old.max_slots] = self.taps
                self.taps = taps
        old.keys, old.values, old.max_slots = keys, values, size
        self._views.clear()  # views of the old storage: rebuilt on demand (and the storage freed)

    def view(self, start: int, stop: int) -> KVCache:
        """A KVCache over rows [start, stop) that shares storage with the pool; the same object
        for the same rows until the cache grows (a step asks for its rows' view every time:
        a copy and two slices, ~50 us a step of single-stream decoding, its Python running cold
        after the pass)."""
        view = self._views.get((start, stop))
        if view is None:
            view = copy.copy(self.cache)
            view.keys = self.cache.keys[:, start:stop]
            view.values = self.cache.values[:, start:stop]
            self._views[(start, stop)] = view
        return view


def _swap(x: Tensor, y: Tensor) -> None:
    """Exchange the contents of two views of the same shape, in place."""
    held = x.clone()
    x.copy_(y)
    y.copy_(held)
