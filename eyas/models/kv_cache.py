"""`KVCache`: pre-allocated key/value buffers that can be written at any slot and compacted.

Layout: keys and values are each one tensor [L, B, KV, S, D] (layers, batch rows, kv heads,
slots, head dim), so that compaction moves every layer in one indexing op. A slot is a place in
the buffer, not a position: the engine decides which slots a token occupies (speculative tokens
go to scratch slots and are either kept, by compaction, or forgotten).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from eyas.utils.huge_pages import zeros_on_huge_pages


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_slots: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_slots, head_dim)
        # On 2 MiB pages where Linux allows it: a batch's step touches every request's part.
        self.keys = zeros_on_huge_pages(shape, dtype, device)  # [L, B, KV, S, D]
        self.values = zeros_on_huge_pages(shape, dtype, device)  # [L, B, KV, S, D]
        self.max_slots = max_slots

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def write(self, layer: int, slots: int | Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [B, KV, T, D] at `slots`: an int start (same for every row) or [B, T]."""
        k, v = k.to(self.keys.dtype), v.to(self.values.dtype)  # no copy when they match
        if isinstance(slots, int):
            end = slots + k.shape[2]
            if end > self.max_slots:
                raise IndexError(f"KV cache overflow: slot {end - 1} >= {self.max_slots} slots")
            self.keys[layer, :, :, slots:end] = k
            self.values[layer, :, :, slots:end] = v
            return
        if k.shape[0] == 1:  # one row (a single request): index_copy_ is ~2x faster here
            self.keys[layer, 0].index_copy_(1, slots[0], k[0])
            self.values[layer, 0].index_copy_(1, slots[0], v[0])
            return
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        # transpose views to [B, S, KV, D]; advanced-index assignment writes through to storage
        self.keys[layer].transpose(1, 2)[rows, slots] = k.transpose(1, 2)
        self.values[layer].transpose(1, 2)[rows, slots] = v.transpose(1, 2)

    def read(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        """Keys and values of slots [0, length) of one layer: [B, KV, length, D] each."""
        return self.keys[layer, :, :, :length], self.values[layer, :, :, :length]

    def layer_tensors(self, layer: int) -> tuple[Tensor, Tensor]:
        """Keys and values of one layer, every slot: [B, KV, S, D] views of the storage."""
        return self.keys[layer], self.values[layer]

    def compact(self, row: int, keep_slots: Tensor | list[int], start: int) -> None:
        """Copy the entries at `keep_slots` of one batch row to slots start, start+1, ...

        Used after verification: the accepted path's entries become contiguous after the
        context; whatever lies beyond them is scratch that the next step overwrites.
        """
        if isinstance(keep_slots, list) and keep_slots == list(range(start, start + len(keep_slots))):
            return  # already in place (an accepted chain): checked without PyTorch ops
        index = torch.as_tensor(keep_slots, dtype=torch.long, device=self.keys.device)
        count = index.numel()
        if count == 0:
            return
        if torch.equal(index, torch.arange(start, start + count, device=index.device)):
            return  # already in place
        self.keys[:, row, :, start : start + count] = self.keys[:, row, :, index]
        self.values[:, row, :, start : start + count] = self.values[:, row, :, index]

    def copy_row(self, source_row: int, target_row: int, length: int) -> None:
        """Copy slots [0, length) of one row onto another (e.g. to fork a prefix)."""
        self.keys[:, target_row, :, :length] = self.keys[:, source_row, :, :length]
        self.values[:, target_row, :, :length] = self.values[:, source_row, :, :length]


class RowsView:
    """The rows of a `KVCache` named per batch element: element n of a pass reads and writes KV
    row rows[n] (how the Python layers run a ragged pass: one query per element, each over its
    own sequence's cache row). Reads gather copies; writes go to the cache's storage."""

    def __init__(self, cache: KVCache, rows: Tensor) -> None:
        self.cache = cache
        self.rows = rows.long()  # [N]
        self.keys = cache.keys  # [L, B, KV, S, D] (its dtype decides the model's path)
        self.max_slots = cache.max_slots

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [N, KV, 1, D] at slots [N, 1] of each element's own row."""
        keys, values = self.cache.layer_tensors(layer)  # [B, KV, S, D]
        at = slots.reshape(-1)
        if int(at.max()) >= self.max_slots:
            raise IndexError(f"KV cache overflow: slot {int(at.max())} >= {self.max_slots} slots")
        keys.transpose(1, 2)[self.rows, at] = k[:, :, 0].to(keys.dtype)
        values.transpose(1, 2)[self.rows, at] = v[:, :, 0].to(values.dtype)

    def read(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        """Each element's row, slots [0, length): [N, KV, length, D] each (copies)."""
        keys, values = self.cache.layer_tensors(layer)
        return keys[self.rows, :, :length], values[self.rows, :, :length]


class LayerSubsetKVCache(KVCache):
    """A `KVCache` that holds only some decoder layers (a layer-skip draft runs only those).

    Layers keep their own indices in calls (`write(layer, ...)`, `read(layer, ...)`); storage is
    [len(layers), B, KV, S, D], so skipped layers cost no memory.
    """

    def __init__(self, layers: Sequence[int], batch_size: int, num_kv_heads: int, max_slots: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        super().__init__(len(layers), batch_size, num_kv_heads, max_slots, head_dim, dtype, device)
        self.layers = tuple(layers)
        self.storage_index = {layer: index for index, layer in enumerate(self.layers)}

    def write(self, layer: int, slots: int | Tensor, k: Tensor, v: Tensor) -> None:
        super().write(self.storage_index[layer], slots, k, v)

    def read(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        return super().read(self.storage_index[layer], length)

    def layer_tensors(self, layer: int) -> tuple[Tensor, Tensor]:
        return super().layer_tensors(self.storage_index[layer])

    def grown(self, max_slots: int) -> LayerSubsetKVCache:
        """A larger cache holding this one's slots (the old one is dropped by the caller)."""
        _, batch, kv_heads, slots, head_dim = self.keys.shape
        bigger = LayerSubsetKVCache(self.layers, batch, kv_heads, max_slots, head_dim,
                                    self.keys.dtype, self.keys.device)
        bigger.keys[:, :, :, :slots] = self.keys
        bigger.values[:, :, :, :slots] = self.values
        return bigger
