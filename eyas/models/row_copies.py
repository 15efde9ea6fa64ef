"""`RowCopies`: rows of a table gathered into a kept tensor through NumPy, for the passes that
run once a decoding step (the EAGLE-3 head's embeddings).

Why: after a target pass has streamed ~100 MB through the caches, each small PyTorch op (an
index, a lookup, a copy) runs cold, ~10-50 us apiece; a NumPy assignment into a buffer
that PyTorch already wraps costs about a microsecond, and gives the same floats (a row copy).

Usage:
    rows = RowCopies(table, capacity=64)   # table [N, ...], any dtype NumPy shares
    x = rows.write([5, 9, 5])              # [3, ...]: table[5], table[9], table[5]
The returned tensor is a view of the buffer: the next `write` overwrites it, so hand it to its
consumer before writing again. A plain tensor (not an inference tensor): writable in any mode.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


class RowCopies:
    def __init__(self, table: Tensor, capacity: int) -> None:
        self.table = table  # what the copies are taken from (callers check it is still theirs)
        self._rows = table.detach().numpy()  # shares table's storage
        with torch.inference_mode(False):
            buffer = torch.empty(capacity, *table.shape[1:], dtype=table.dtype)
        self._buffer = buffer.numpy()
        self._views = [buffer[:count] for count in range(capacity + 1)]  # by row count

    @property
    def capacity(self) -> int:
        return len(self._views) - 1

    def write(self, indices: Sequence[int]) -> Tensor:
        """[len(indices), ...]: the table's rows at `indices`, in order."""
        self._buffer[: len(indices)] = self._rows[indices]
        return self._views[len(indices)]
