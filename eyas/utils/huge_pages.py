"""Zeroed CPU tensors on 2 MiB pages: for the large buffers that every step reads from end to end.

Why: a continuous batch's KV cache spreads over hundreds of MB, and each decode step writes each
request's new keys and values into, and reads every request's cache from, its own part of it. On
4 KiB pages that touches a different page for each request, kv head and layer, and the page walks
cost more than the writes: rotary + KV writes took 2.9-3.6 ms of a step of 64 requests on 2 MiB
pages against 11.1-12.2 ms on 4 KiB ones, attention 10-20% less (BENCHMARKS.md section 4). Linux gives a process
transparent huge pages where it asks for them (`/sys/kernel/mm/transparent_hugepage/enabled` set
to `madvise`, the common default, or `always`): the buffer is allocated 2 MiB-aligned,
`madvise(MADV_HUGEPAGE)` marks it before anything touches it, and zeroing it faults it in on 2
MiB pages. Elsewhere (another OS, a GPU tensor, a small buffer, THP off) it is `torch.zeros`.

Usage:
    from eyas.utils.huge_pages import zeros_on_huge_pages
    keys = zeros_on_huge_pages((layers, batch, kv_heads, slots, head_dim), torch.float16)
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from typing import Sequence

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20  # bytes
MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise, or None where there is none to call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def zeros_on_huge_pages(shape: Sequence[int], dtype: torch.dtype,
                        device: str | torch.device = "cpu") -> Tensor:
    """torch.zeros(shape, dtype) whose storage starts on a 2 MiB boundary and is marked for huge
    pages before it is first written (a view into a buffer up to 2 MiB larger)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if device.type != "cpu" or nbytes < HUGE_PAGE or madvise is None:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    buffer = raw[skip : skip + nbytes]
    # Whole 2 MiB pages only; a refusal (THP off, an old kernel) leaves ordinary pages.
    madvise(buffer.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)
    return buffer.view(dtype).view(tuple(shape)).zero_()
