"""Head-training throughput per CPU second: the trainer's steps from two source trees, alternated.

Usage:
    git archive OLD_COMMIT eyas | tar -x -C /tmp/eyas-old
    OMP_NUM_THREADS=1 python scripts/bench-train-steps.py --tree old=/tmp/eyas-old --tree new=. \
        --features features24 --rounds 3 --epochs 2 -- --draft-vocab-size 8192 --ttt-steps 5

Where bench-train.py reads wall-clock tokens/s, which a shared machine's load moves by 2-4x
between runs, this one counts the CPU time of the training steps alone (time.process_time of a
one-thread process, so time spent waiting for a busy core is not counted), per epoch: each run
builds a Trainer from its tree (offline, micro batch 1, no held-out split), trains --epochs
epochs over the store and reports real tokens per CPU second of each epoch (the first epoch
without its first two steps, the warm-up). Each round runs every tree once, in turn; the table
gives the medians and the ratio to the first tree, and each tree's final loss (equal code paths
give equal losses).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch
from eyas.training.config import TrainConfig
from eyas.training.trainer import Trainer
features, out, epochs, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
config = TrainConfig(model="smollm2-135m", features=features, output=out, eval_fraction=0.0,
                     save_every=0, progress=False, epochs=epochs, **extra)
trainer = Trainer(config)
per_epoch = trainer.plan.steps_per_epoch
rates, loss = [], 0.0
for epoch in range(epochs):
    first = 2 if epoch == 0 else 0
    for step in range(epoch * per_epoch, epoch * per_epoch + first):
        trainer.train_step(step)
    tokens, started = 0, time.process_time()
    for step in range(epoch * per_epoch + first, (epoch + 1) * per_epoch):
        stats = trainer.train_step(step)
        tokens, loss = tokens + stats.tokens, stats.loss
    rates.append(tokens / (time.process_time() - started))
print(json.dumps({"rates": rates, "loss": loss}))
"""

OPTIONS = {"--draft-vocab-size": ("draft_vocab_size", int), "--ttt-steps": ("ttt_steps", int),
           "--micro-batch-size": ("micro_batch_size", int), "--lr": ("learning_rate", float)}


def parse_extra(words: list[str]) -> dict:
    """`eyas train` flags (those in OPTIONS) -> TrainConfig fields."""
    extra = {}
    for flag, value in zip(words[::2], words[1::2]):
        if flag not in OPTIONS:
            raise SystemExit(f"unsupported option {flag}; accepted: {', '.join(OPTIONS)}")
        name, kind = OPTIONS[flag]
        extra[name] = kind(value)
    return extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--features", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="--draft-vocab-size, --ttt-steps, --micro-batch-size, --lr")
    args = parser.parse_args()
    extra = json.dumps(parse_extra(args.extra))
    trees = [item.split("=", 1) for item in args.tree]
    work = tempfile.TemporaryDirectory(prefix="bench-train-steps-")
    rates: dict[str, list[list[float]]] = {name: [] for name, _ in trees}
    losses: dict[str, float] = {}
    for round_number in range(args.rounds):
        for name, tree in trees:
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
            out = Path(work.name) / f"{name}-{round_number}"
            # `python -c` puts the working directory first on sys.path: run in the tree
            result = subprocess.run([sys.executable, "-c", CHILD, str(Path(args.features).resolve()), str(out),
                                     str(args.epochs), extra],
                                    env=env, cwd=Path(tree).resolve(), check=True, capture_output=True, text=True)
            report = json.loads(result.stdout.strip().splitlines()[-1])
            rates[name].append(report["rates"])
            losses[name] = report["loss"]
            print(f"round {round_number + 1} {name}: " + ", ".join(
                f"epoch {e + 1} {r:.1f}" for e, r in enumerate(report["rates"])) + " tokens/CPU-s", flush=True)
    print(f"\n{args.epochs} epochs of {args.features}, {' '.join(args.extra)}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    first = trees[0][0]
    for name, _ in trees:
        cells = []
        for epoch in range(args.epochs):
            median = statistics.median(run[epoch] for run in rates[name])
            base = statistics.median(run[epoch] for run in rates[first])
            cells.append(f"epoch {epoch + 1}: median {median:.1f} ({median / base:.2f}x {first})")
        print(f"{name:>8}: {'; '.join(cells)}; final loss {losses[name]:.5f}")


if __name__ == "__main__":
    main()
