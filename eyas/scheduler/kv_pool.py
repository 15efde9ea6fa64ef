"""`KVPool`: one shared KVCache [L, R, KV, S, D] whose rows are lent to running requests.

- A request holds one row from admission to finish; its slots [0, context_length) hold its
  committed tokens, the slots after them are scratch for the step's root, drafts and padding.
- Occupied rows stay packed at the bottom: when requests leave, the highest occupied rows are
  moved into the holes (a copy of their committed slots only). A decode pass then covers rows
  [0, span) with few or no idle rows in between.
- S starts small and doubles when a row needs more (up to `max_slots`), so memory follows the
  longest live request rather than the worst case.
- Rows and slots change only between steps (the engine guarantees nothing is in flight).
"""

from __future__ import annotations

import copy

import torch

from eyas.engine.target import Target
from eyas.models.kv_cache import KVCache


class KVPool:
    def __init__(self, target: Target, rows: int, max_slots: int, initial_slots: int = 256) -> None:
        config = target.config
        self.max_slots = max_slots
        self.cache = KVCache(config.num_hidden_layers, rows, config.num_key_value_heads,
                             min(initial_slots, max_slots), config.head_dim, dtype=target.kv_dtype,
                             device=target.device)
        self.owners: list[object | None] = [None] * rows  # request holding each row

    @property
    def rows(self) -> int:
        return len(self.owners)

    @property
    def slots(self) -> int:
        return self.cache.max_slots

    @property
    def num_free(self) -> int:
        return self.owners.count(None)

    def bytes_per_slot(self) -> int:
        keys = self.cache.keys
        per_row_slot = keys.shape[0] * keys.shape[2] * keys.shape[4] * keys.element_size()
        return 2 * per_row_slot * keys.shape[1]  # keys + values, every row

    def allocate(self, owner: object) -> int:
        """The lowest free row (keeps occupied rows packed)."""
        row = self.owners.index(None)
        self.owners[row] = owner
        return row

    def free(self, row: int) -> None:
        self.owners[row] = None

    def compact(self) -> list[tuple[object, int, int]]:
        """Move the highest occupied rows into the lowest free ones until the occupied rows
        are packed. Returns (owner, old row, new row) per move; the caller copies each owner's
        committed slots with `move_row` and updates its row."""
        moves = []
        while True:
            occupied = [r for r, owner in enumerate(self.owners) if owner is not None]
            free = [r for r, owner in enumerate(self.owners) if owner is None]
            if not occupied or not free or free[0] > occupied[-1]:
                return moves
            source, target = occupied[-1], free[0]
            owner = self.owners[source]
            self.owners[target], self.owners[source] = owner, None
            moves.append((owner, source, target))

    @torch.inference_mode()
    def move_row(self, source: int, target: int, length: int) -> None:
        if length > 0:
            self.cache.copy_row(source, target, length)

    def ensure_slots(self, needed: int) -> None:
        """Grow S (doubling) so that slots [0, needed) exist in every row."""
        if needed <= self.cache.max_slots:
            return
        if needed > self.max_slots:
            raise IndexError(f"KV pool overflow: {needed} slots needed, at most {self.max_slots}")
        size = self.cache.max_slots
        while size < needed:
            size *= 2
        size = min(size, self.max_slots)
        old = self.cache
        shape = list(old.keys.shape)
        shape[3] = size
        with torch.inference_mode(False):  # plain tensors, writable in and out of inference mode
            keys = torch.zeros(shape, dtype=old.keys.dtype, device=old.keys.device)
            values = torch.zeros(shape, dtype=old.values.dtype, device=old.values.device)
            keys[:, :, :, : old.max_slots] = old.keys
            values[:, :, :, : old.max_slots] = old.values
        old.keys, old.values, old.max_slots = keys, values, size

    def view(self, start: int, stop: int) -> KVCache:
        """A KVCache over rows [start, stop) that shares storage with the pool."""
        view = copy.copy(self.cache)
        view.keys = self.cache.keys[:, start:stop]
        view.values = self.cache.values[:, start:stop]
        return view
