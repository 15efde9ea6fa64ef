"""What a small op costs right after a pass has streamed ~100 MB through the caches, against
the same op warm: why a single-stream step makes no small PyTorch ops between its two C++
calls (models/llama.py `decode_rows`, models/output_layer.py `greedy_tokens`). Each op is
timed 200 times, warm (back to back) and cold (after reading a 100 MB array); medians.

Usage:
    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/cold-ops.py
"""

from __future__ import annotations

import statistics
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import numpy as np
import torch

from eyas.models.extension import module


def median_us(op, flush: np.ndarray | None, repeats: int = 200) -> float:
    seconds = []
    for _ in range(repeats):
        if flush is not None:
            flush.sum()  # streams 100 MB: what a target pass does to the caches
        started = time.perf_counter()
        op()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1e6


def main() -> None:
    x, weight = torch.randn(1, 576), torch.randn(576)
    logits = np.random.default_rng(0).random(49152, dtype=np.float32)
    ops = {"torch.empty(4)": lambda: torch.empty(4),
           "x[0] (an index)": lambda: x[0],
           "the extension's rms_norm of one row": lambda: module().torch_rms_norm(x, weight, 1e-5),
           "np.argmax over 49,152 logits": lambda: np.argmax(logits),
           "a Python loop of 100 additions": lambda: sum(i for i in range(100))}
    flush = np.ones(100_000_000 // 8)
    print(f"{'op':40s} {'warm us':>8s} {'cold us':>8s}")
    for name, op in ops.items():
        print(f"{name:40s} {median_us(op, None):8.1f} {median_us(op, flush):8.1f}")


if __name__ == "__main__":
    main()
