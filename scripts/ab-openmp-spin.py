"""What PyTorch's OpenMP spin (GOMP_SPINCOUNT) costs eyas's C++ passes, and float32 decoding.

    python scripts/ab-openmp-spin.py [--counts 300000,10000,1000] [--rounds 2]

Each setting runs in its own process (libgomp reads it when torch loads), settings alternated
round by round, 2 threads. Measured in each process, on int4 SmolLM2 with 256 cached tokens:
a one-token pass of the fused stack right after a parallel torch op (`tril` of a 2 x 258 mask)
against the same pass after the one before it (`after tril` / `steady`, median ms); and, on
the float32 model (Python layers, every op a torch op), a one-token step at 256 cached tokens
(median ms). See eyas/openmp_spin.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
import torch
from eyas.engine.generate import new_cache
from eyas.engine.target import load_target

def stack_pass():
    target = load_target("smollm2-135m", dtype="int4")
    model, config = target.model, target.config
    stack = model.fused_layers()
    layers, context = list(range(len(stack))), 256
    ids = torch.randint(0, config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    cache = new_cache(target, 1, context + 1)
    model(ids[:, :context], cache=cache, write_at=0, logits_at=None)
    positions = torch.arange(context, context + 1)[None]  # [1, 1]
    cos_table, sin_table = model.rope_tables(context + 1)
    x = model.embed_tokens(ids[0, context:]).contiguous()  # [1, H]
    run = lambda: stack.run(x, cos_table[positions[0]], sin_table[positions[0]], cache, layers, positions,
                            context + 1, None)
    ones = torch.ones(2, context + 2, dtype=torch.bool)
    after, steady = [], []
    for _ in range(40):
        for _ in range(4):
            run()
        started = time.perf_counter(); run(); steady.append(time.perf_counter() - started)
        ones.tril(context)
        started = time.perf_counter(); run(); after.append(time.perf_counter() - started)
    return statistics.median(after) * 1000, statistics.median(steady) * 1000

def float32_step():
    target = load_target("smollm2-135m", dtype="float32")
    model, config = target.model, target.config
    ids = torch.randint(0, config.vocab_size, (1, 257), generator=torch.Generator().manual_seed(0))
    cache = new_cache(target, 1, 257)
    model(ids[:, :256], cache=cache, write_at=0, logits_at=None)
    steps = []
    for _ in range(40):
        started = time.perf_counter()
        model(ids[:, 256:], cache=cache, write_at=256, logits_at="last")
        steps.append(time.perf_counter() - started)
    return statistics.median(steps) * 1000

with torch.inference_mode():
    after, steady = stack_pass()
    print(json.dumps({"after": after, "steady": steady, "float32": float32_step()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="300000,10000,1000", help="GOMP_SPINCOUNT values, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    counts = args.counts.split(",")
    results: dict[str, list[dict]] = {count: [] for count in counts}
    for _ in range(args.rounds):
        for count in counts:
            env = dict(os.environ, GOMP_SPINCOUNT=count, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
            env.pop("OMP_WAIT_POLICY", None)
            out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
            results[count].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.rounds} round(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '2')}; medians over rounds")
    print("GOMP_SPINCOUNT | stack pass after tril (ms) | steady (ms) | float32 one-token step (ms)")
    for count, rows in results.items():
        cell = lambda key: statistics.median(row[key] for row in rows)
        print(f"{count} | {cell('after'):.2f} | {cell('steady'):.2f} | {cell('float32'):.2f}")


if __name__ == "__main__":
    main()
