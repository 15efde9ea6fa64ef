"""How long PyTorch's OpenMP threads spin after a parallel op: short, by default.

eyas's C++ passes (the fused int4 stack, the output screen, attention) run on their own worker
threads (models/csrc/worker_pool.h). PyTorch's ops run on libgomp's, which after every parallel
region busy-wait for the next one: GOMP_SPINCOUNT iterations, 300,000 by default, 1-2 ms. On a
machine with as many cores as threads (2 here), a C++ pass that follows a parallel torch op
(`tril` of a causal mask, `topk` over a draft vocabulary, a sampling `softmax`) shares its cores
with that spin: a one-token pass of int4 SmolLM2's stack took 3.77 ms right after one against
2.69 at 10,000 iterations (2.53-2.65 after another pass; 2 threads, Intel Xeon model 167,
2026-11-27; scripts/ab-openmp-spin.py), and a speculative step of the shipped head 7.4-7.5 ms
against 6.2-6.35 (scripts/trace-fallback.py). At 10,000 iterations the
spin is over before it matters, and float32 decoding, whose many small torch ops find the threads
still spinning between them, runs as fast as with the default (35.6-35.8 tok/s against 35.5-35.6);
at 1,000 it lost a third (22.8).

libgomp reads the setting once, when PyTorch loads it: `apply()` runs when `eyas` is imported
and takes effect in a process that imports eyas before torch (the `eyas` command, `python -m
eyas...`, the tests); child processes inherit it. A value the user sets (GOMP_SPINCOUNT, or
OMP_WAIT_POLICY, which libgomp reads as a spin policy of its own) is left alone.

Usage:
    import eyas                  # before torch: GOMP_SPINCOUNT is then 10000 or the user's setting
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"


def apply() -> None:
    """Set GOMP_SPINCOUNT to SPIN_COUNT unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT

