"""The worker pool's two ways of handing out a parallel region, side by side in one process:
contiguous segments per thread with stealing ("segments", the default) against chunks in turn
from one counter ("chunks"), csrc/worker_pool.h, EYAS_POOL_SPLIT.

    python scripts/ab-pool-split.py [MODELS] [TOKENS] [ROUNDS] [THREADS]
    python scripts/ab-pool-split.py qwen2.5-coder-1.5b,smollm2-135m 1,4 7 2    # the default

For each model (int4), one greedy pass over T new tokens after 256 cached ones (the pass that
`eyas bench costs` and `eyas bench profile` time, engine/speculative/sizing.py verify_pass) is
timed ROUNDS times per split, the two splits alternating (and which goes first), each round 15
passes on the wall clock with THREADS threads. Prints the median over rounds of each round's
median and of its fastest pass (on a loaded machine the fastest passes are those in which both
threads ran), old/new ratios and the load average before and after (the splits give the same bits:
the script also checks that both give the same logits on one pass).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.engine.generate import new_cache
from eyas.engine.speculative.sizing import prefill_context, verify_pass
from eyas.engine.target import load_target
from eyas.models.extension import module

CONTEXT = 256
PASSES = 15  # per round and split
SPLITS = ("chunks", "segments")


def timed_ms(step, passes: int) -> tuple[float, float]:
    """(median, fastest) milliseconds of `passes` calls of step."""
    times = []
    for _ in range(passes):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times), 1e3 * min(times)


@torch.inference_mode()
def compare(model: str, tokens: int, rounds: int, ext) -> None:
    target = load_target(model, dtype="int4")
    cache = new_cache(target, 1, CONTEXT + tokens + 1)
    prefill_context(target, cache, CONTEXT)
    step = verify_pass(target, cache, CONTEXT, tokens)
    ids = torch.arange(100, 100 + tokens).unsqueeze(0)  # [1, T]
    logits = {}
    for split in SPLITS:  # same bits either way
        ext.set_pool_split(split)
        logits[split] = target.model(ids, cache=cache, write_at=CONTEXT, kv_len=CONTEXT + tokens).logits
    same = torch.equal(logits["chunks"], logits["segments"])
    step()  # warm-up
    samples: dict[str, list[float]] = {split: [] for split in SPLITS}  # each round's median
    fastest: dict[str, list[float]] = {split: [] for split in SPLITS}  # each round's fastest pass
    for round_index in range(rounds):
        for split in SPLITS if round_index % 2 == 0 else SPLITS[::-1]:
            ext.set_pool_split(split)
            median, best = timed_ms(step, PASSES)
            samples[split].append(median)
            fastest[split].append(best)
    old, new = (statistics.median(samples[split]) for split in SPLITS)
    old_best, new_best = (statistics.median(fastest[split]) for split in SPLITS)
    print(f"{model} T={tokens}: median of round medians: chunks {old:.2f} ms, segments {new:.2f} ms, "
          f"old/new {old / new:.3f}; median of round minimums (a loaded machine inflates them least): "
          f"chunks {old_best:.2f} ms, segments {new_best:.2f} ms, old/new {old_best / new_best:.3f} "
          f"(round medians: chunks {[round(v, 2) for v in samples['chunks']]}, "
          f"segments {[round(v, 2) for v in samples['segments']]}); same logits: {same}", flush=True)
    ext.set_pool_split("segments")


def main() -> None:
    models = (sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b,smollm2-135m").split(",")
    tokens = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,4").split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    torch.set_num_threads(threads)
    ext = module()
    if ext is None:
        raise SystemExit("the C++ extension is not built: nothing to compare")
    print(f"threads {threads}, load average before: {os.getloadavg()}", flush=True)
    for model in models:
        for size in tokens:
            compare(model, size, rounds, ext)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
