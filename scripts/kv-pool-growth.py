"""What growing the serving engine's KV pool costs: each growth of S (slots per row, doubled on
demand, scheduler/kv_pool.py) timed inside a closed-loop serving run, then the allocation alone:
a pool-sized buffer on 2 MiB pages (utils/huge_pages.py) against torch.zeros, three times each
(where Linux has no free 2 MiB pages at hand it compacts memory while the buffer is first
written, which is most of a growth's time).

Usage:
    PYTHONPATH=$PWD python scripts/kv-pool-growth.py [CONCURRENCY] [PROMPTS] [MAX_TOKENS]
    PYTHONPATH=$PWD python scripts/kv-pool-growth.py 16 32 128
"""

from __future__ import annotations

import runpy
import sys
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

import eyas.scheduler.kv_pool as kv_pool
from eyas.utils.huge_pages import zeros_on_huge_pages


def main() -> None:
    concurrency = sys.argv[1] if len(sys.argv) > 1 else "16"
    prompts = sys.argv[2] if len(sys.argv) > 2 else "32"
    tokens = sys.argv[3] if len(sys.argv) > 3 else "128"
    growths: list[tuple[int, int, tuple[int, ...], float]] = []
    ensure_slots = kv_pool.KVPool.ensure_slots

    def timed(pool, needed: int) -> None:
        before, started = pool.cache.max_slots, time.perf_counter()
        ensure_slots(pool, needed)
        if pool.cache.max_slots != before:
            growths.append((before, pool.cache.max_slots, tuple(pool.cache.keys.shape), time.perf_counter() - started))

    kv_pool.KVPool.ensure_slots = timed
    sys.argv = ["measure", "--num-prompts", prompts, "--max-tokens", tokens, "--configs", "none~off",
                "--concurrency", concurrency, "--rounds", "1"]
    try:
        runpy.run_module("eyas.scheduler.measure", run_name="__main__")
    except SystemExit as done:  # the measurement's own exit; its growths are still to report
        if done.code:
            raise
    for before, after, shape, seconds in growths:
        print(f"S {before} -> {after} (keys {list(shape)}): {seconds * 1e3:.0f} ms")
    if growths:
        shape = list(growths[-1][2])
        for _ in range(3):
            started = time.perf_counter()
            buffer = zeros_on_huge_pages(shape, torch.float16)
            huge = time.perf_counter() - started
            del buffer
            started = time.perf_counter()
            buffer = torch.zeros(shape, dtype=torch.float16)
            plain = time.perf_counter() - started
            del buffer
            print(f"a {shape} float16 buffer: on 2 MiB pages {huge * 1e3:.0f} ms, torch.zeros {plain * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
