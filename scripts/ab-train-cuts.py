"""The two last exact cuts of a training step, alone and together, in one process: the unroll of
an older tree (every row through every TTT step) against this tree's (rows scored at no later
step skipped), each with the target's argmax computed every step or kept from the first epoch.

Usage:
    git archive OLD_COMMIT eyas | tar -x -C /tmp/eyas-old
    OMP_NUM_THREADS=1 python scripts/ab-train-cuts.py FEATURES ROUNDS /tmp/eyas-old

One Trainer (offline, N = 8,192, K = 5, micro batch 1) trains one epoch to fill the argmax cache
and warm up; then each round runs every arm over one epoch of steps, in turn, and counts real
tokens per CPU second (time.process_time: time spent waiting for a busy core is not counted).
The arms share the head, so each trains on where the last one left off (the speed is what is
compared here; equal losses are checked by bench-train-steps.py).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import tempfile
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.training.config import TrainConfig
from eyas.training.trainer import Trainer


def load_old_ttt(tree: str):
    """The ttt module of another source tree (its TrainingTimeTest)."""
    spec = importlib.util.spec_from_file_location("old_ttt", f"{tree}/eyas/training/ttt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_ttt"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    if len(sys.argv) != 4 or not sys.argv[2].isdigit() or int(sys.argv[2]) < 1:
        raise SystemExit("usage: ab-train-cuts.py FEATURES ROUNDS(>= 1) OLD_TREE")
    features, rounds, old_tree = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    config = TrainConfig(model="smollm2-135m", features=features, output=tempfile.mkdtemp(prefix="ab-train-cuts-"),
                         draft_vocab_size=8192, ttt_steps=5, max_steps=1000, save_every=0, eval_fraction=0.0,
                         progress=False)
    trainer = Trainer(config)
    per_epoch = trainer.plan.steps_per_epoch
    old_unroll = load_old_ttt(old_tree).TrainingTimeTest(trainer.head, config.ttt_steps)
    arms = {"every row, argmax each step": (old_unroll, False),
            "rows skipped, argmax each step": (trainer.model, False),
            "rows skipped, argmax cached": (trainer.model, True)}
    for step in range(per_epoch):  # 1. fill the argmax cache; warm up
        trainer.train_step(step)
    filled = dict(trainer.label_cache)
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for round_number in range(rounds):  # 2. each arm over one epoch, in turn
        for name, (unroll, cached) in arms.items():
            trainer.model = unroll
            tokens, started = 0, time.process_time()
            for step in range(per_epoch * (round_number + 1), per_epoch * (round_number + 2)):
                if not cached:
                    trainer.label_cache.clear()
                tokens += trainer.train_step(step).tokens
            rates[name].append(tokens / (time.process_time() - started))
            trainer.label_cache.update(filled)
        print(f"round {round_number + 1}: " + ", ".join(f"{name} {r[-1]:.1f}" for name, r in rates.items()), flush=True)
    base = statistics.median(rates["every row, argmax each step"])
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:32s} median {median:6.1f} tokens/CPU-s, {median / base:.2f}x  "
              f"({' '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
