"""How long a one-token pass takes right after a wider one: the passes that follow a prompt's
prefill, and what the tree sizer's timing order has to respect (engine/speculative/sizing.py).

For each `--before` size B: a pass over B tokens, then `--after` one-token passes, each timed;
`--rounds` times, medians per position. `--pause-ms` also times a one-token pass after a pause
(the CPU caches left to other work).

Usage:
    PYTHONPATH=. python scripts/narrow-after-wide.py [--model smollm2-135m] [--before 2 16 64]
        [--after 4] [--rounds 15] [--pause-ms 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting)
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--before", type=int, nargs="+", default=[2, 16, 64])
    parser.add_argument("--after", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--pause-ms", type=float, default=20.0)
    args = parser.parse_args()
    if min(args.before) < 1 or args.after < 1 or args.rounds < 1:
        parser.error("--before sizes, --after and --rounds must be positive")

    from eyas.engine.generate import new_cache
    from eyas.engine.speculative import sizing
    from eyas.engine.target import load_target

    target = load_target(args.model, dtype=args.dtype)
    cache = new_cache(target, 1, args.context + max(args.before) + 1)

    def timed(step) -> float:
        started = time.perf_counter()
        step()
        return time.perf_counter() - started

    with torch.inference_mode():
        sizing.prefill_context(target, cache, args.context)
        steps = {size: sizing.verify_pass(target, cache, args.context, size) for size in {1, *args.before}}
        for step in steps.values():
            step()  # warm-up
        print(f"{args.model} ({args.dtype}), {torch.get_num_threads()} threads, {args.context} cached tokens; "
              f"ms of each one-token pass that follows, medians of {args.rounds} rounds")
        for size in args.before:
            rounds = []
            for _ in range(args.rounds):
                steps[size]()
                rounds.append([timed(steps[1]) for _ in range(args.after)])
            medians = [statistics.median(r[i] for r in rounds) * 1e3 for i in range(args.after)]
            print(f"after a {size}-token pass: " + " ".join(f"{m:.2f}" for m in medians))
        if args.pause_ms > 0:
            paused = []
            for _ in range(args.rounds):
                steps[1]()
                time.sleep(args.pause_ms / 1e3)
                paused.append(timed(steps[1]))
            print(f"after a one-token pass and {args.pause_ms:g} ms idle: {statistics.median(paused) * 1e3:.2f}")


if __name__ == "__main__":
    main()
