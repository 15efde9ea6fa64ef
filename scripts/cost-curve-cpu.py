"""The int4 target's cost curve on the calling thread's CPU time: medians of greedy passes over
T new tokens after 256 cached ones (the pass `eyas bench costs` times), for side-by-side
comparisons of two builds on a machine that other processes load (their wall time would count
the waits for a core). One thread: run it with OMP_NUM_THREADS=1.

Usage (alternate the two checkouts, each with its own extension folder):
    OMP_NUM_THREADS=1 PYTHONPATH=. EYAS_EXT_DIR=/tmp/ext python scripts/cost-curve-cpu.py \\
        --tokens 1,2,4,8,16,32,64 --repeats 15 --out curve.json
"""

from __future__ import annotations

import argparse
import json
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", required=True, help="JSON file: {T: median CPU ms}")
    args = parser.parse_args()
    if torch.get_num_threads() != 1:
        raise SystemExit("CPU time measures one thread: set OMP_NUM_THREADS=1")
    from eyas.engine.generate import new_cache
    from eyas.engine.speculative.sizing import prefill_context, verify_pass
    from eyas.engine.target import load_target

    sizes = [int(t) for t in args.tokens.split(",")]
    target = load_target(args.model, dtype="int4")
    cache = new_cache(target, 1, args.context + max(sizes) + 1)
    medians = {}
    with torch.inference_mode():
        prefill_context(target, cache, args.context)  # sample text, as `eyas bench costs` times
        for size in sizes:
            step = verify_pass(target, cache, args.context, size)
            step()
            times = []
            for _ in range(args.repeats):
                started = time.thread_time()
                step()
                times.append(time.thread_time() - started)
            medians[size] = 1000 * sorted(times)[len(times) // 2]
    with open(args.out, "w") as handle:
        json.dump(medians, handle)


if __name__ == "__main__":
    main()
