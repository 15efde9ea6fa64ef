"""The KV cache's buffers on 2 MiB pages (eyas/utils/huge_pages.py): zeroed, the requested shape
and dtype, starting on a 2 MiB boundary, and marked for transparent huge pages where Linux has
them; small buffers are plain torch.zeros."""

from pathlib import Path

import pytest
import torch

from eyas.models.kv_cache import KVCache
from eyas.utils.huge_pages import HUGE_PAGE, zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_buffer_is_zeroed_aligned_and_of_the_shape_asked():
    shape = (3, 4, 3, 1000, 64)  # 4.6 MB of float16
    x = zeros_on_huge_pages(shape, torch.float16)
    assert x.shape == shape and x.dtype == torch.float16 and x.is_contiguous()
    assert x.data_ptr() % HUGE_PAGE == 0
    assert int(torch.count_nonzero(x)) == 0
    x[2, 3, 2, 999, 63] = 5.0  # the last element is inside the buffer
    assert float(x.sum()) == 5.0


@pytest.mark.skipif(not THP.exists(), reason="this kernel has no transparent huge pages")
def test_a_large_buffer_is_marked_for_huge_pages():
    x = zeros_on_huge_pages((8, HUGE_PAGE // 4), torch.float32)  # 16 MiB
    assert "hg" in vm_flags(x.data_ptr())
    assert "hg" in vm_flags(x.data_ptr() + x.numel() * 4 - 1)


def test_a_small_buffer_is_plain_zeros():
    x = zeros_on_huge_pages((5, 7), torch.float32)
    assert torch.equal(x, torch.zeros(5, 7)) and x.storage_offset() == 0


def test_the_kv_cache_keeps_its_layout_and_moves_rows_on_huge_pages():
    cache = KVCache(num_layers=2, batch_size=2, num_kv_heads=3, max_slots=2048, head_dim=64,
                    dtype=torch.float16)
    assert cache.keys.shape == (2, 2, 3, 2048, 64) and cache.keys.data_ptr() % HUGE_PAGE == 0
    k = torch.arange(2 * 3 * 5 * 64, dtype=torch.float32).reshape(2, 3, 5, 64) / 1000
    cache.write(1, 7, k, -k)
    keys, values = cache.read(1, 12)
    assert torch.equal(keys[:, :, 7:12], k.half()) and torch.equal(values[:, :, 7:12], (-k).half())
    cache.compact(1, [9, 11], 7)
    assert torch.equal(cache.keys[1, 1, :, 7:9], k[1, :, [2, 4]].half())
