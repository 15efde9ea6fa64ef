"""Head-training throughput: the same `eyas train` command from two source trees, alternated.

Usage:
    git archive OLD_COMMIT eyas | tar -x -C /tmp/eyas-old          # the tree to compare against
    OMP_NUM_THREADS=2 python scripts/bench-train.py --tree old=/tmp/eyas-old --tree new=. \
        --features features64 --rounds 3 --steps 12 -- --draft-vocab-size 8192 --ttt-steps 5
    python scripts/bench-train.py --tree mb1=. --tree "mb4=.::--micro-batch-size 4" ...
    python scripts/bench-train.py ... --steps 600 --after 300 --log-every 50   # a 294-sample store's 2nd epoch

Each round runs every tree once, in turn (a shared machine's load changes over minutes), with
`eyas train --max-steps STEPS --log-every STEPS/3` and the arguments after `--`; a run's
throughput is the median tokens/s of its logged windows after the first (the first window
holds the warm-up). Model loading and the store's first read are outside the windows. The table
gives each tree's runs, their median, and the ratio to the first tree; the final training loss of
each tree is printed too (equal code paths give equal losses).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def one_run(tree: Path, features: str, steps: int, extra: list[str], out: Path,
            after: int = 0, every: int | None = None) -> tuple[float, float]:
    """(tokens/s, last training loss) of one `eyas train` run from `tree`: the median of its
    logged windows after the first, or of those that end after step `after` where given."""
    every = every or max(1, steps // 3)
    command = [sys.executable, "-m", "eyas", "train", "--model", "smollm2-135m",
               "--features", str(Path(features).resolve()), "--out", str(out.resolve()), "--max-steps", str(steps), "--log-every", str(every), "--save-every", "0",
               "--eval-fraction", "0", "--no-progress", *extra]
    # `python -m` puts the working directory first on sys.path: run in the tree, or the tree the
    # script is started from would shadow it
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    subprocess.run(command, env=env, cwd=tree.resolve(), check=True, stdout=subprocess.DEVNULL)
    with open(out / "metrics.csv", encoding="utf-8") as handle:
        rows = [row for row in csv.DictReader(handle) if row["split"] == "train"]
    windows = [row for row in rows if int(row["step"]) > after] if after else rows[1:]
    rates = [float(row["tokens_per_s"]) for row in windows] or [float(rows[0]["tokens_per_s"])]
    return statistics.median(rates), float(rows[-1]["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH[::ARGS]",
                        help="a source tree to run `python -m eyas` from, and arguments for it alone")
    parser.add_argument("--features", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--after", type=int, default=0,
                        help="count only the windows that end after this step (e.g. the store's "
                             "sample count: later epochs, whose target argmax is cached)")
    parser.add_argument("--log-every", type=int, default=None, help="steps per logged window (default: steps / 3)")
    parser.add_argument("extra", nargs="*", help="more `eyas train` arguments (after --)")
    args = parser.parse_args()
    trees = []  # (name, source tree, its own extra arguments)
    for item in args.tree:
        name, rest = item.split("=", 1)
        path, _, own = rest.partition("::")
        trees.append((name, Path(path), own.split()))
    scratch = tempfile.TemporaryDirectory(prefix="bench-train-")  # each run's checkpoints, removed at the end
    work = Path(scratch.name)
    rates: dict[str, list[float]] = {name: [] for name, _, _ in trees}
    losses: dict[str, float] = {}
    for round_number in range(args.rounds):
        for name, tree, own in trees:
            rate, loss = one_run(tree, args.features, args.steps, [*args.extra, *own],
                                 work / f"{name}-{round_number}", args.after, args.log_every)
            rates[name].append(rate)
            losses[name] = loss
            print(f"round {round_number + 1} {name}: {rate:.1f} tok/s, final loss {loss:.5f}", flush=True)
    first = statistics.median(rates[trees[0][0]])
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"\n`eyas train --max-steps {args.steps} {' '.join(args.extra)}`, OMP_NUM_THREADS={threads}")
    for name, _, own in trees:
        median = statistics.median(rates[name])
        print(f"{name:>8}: {' '.join(f'{r:.1f}' for r in rates[name])} tok/s, median {median:.1f}, "
              f"{median / first:.2f}x {trees[0][0]}; final loss {losses[name]:.5f} {' '.join(own)}")


if __name__ == "__main__":
    main()
