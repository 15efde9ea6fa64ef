"""Learning-rate schedule: linear warmup, then a decay to `min_lr_ratio * base_lr` at the last
step: cosine (the default), linear, or none (constant at the peak).

A pure function of the schedule's position, so that resuming needs only the step number (and,
under a time budget, the training time spent). The position is the optimizer step; with a time
budget (`max_time_s`) it is the larger of the step and the budget's share spent times
`total_steps`, so a run stopped by its budget still warms up and decays to its floor.

Usage:
    schedule = WarmupSchedule(base_lr=1e-4, total_steps=1000, warmup_steps=20)
    schedule = WarmupSchedule(base_lr=1e-4, total_steps=1000, warmup_steps=20, decay="linear")
    schedule.apply(optimizer, step)      # before optimizer.step() of step `step` (0-based)
    budget = WarmupSchedule(base_lr=1e-4, total_steps=10**6, warmup_steps=2000, max_time_s=3600)
    budget.apply(optimizer, budget.position(step, elapsed_s))
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from torch.optim import Optimizer

from eyas.errors import EyasError

DECAYS = ("cosine", "linear", "constant")


@dataclass
class WarmupSchedule:
    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    decay: str = "cosine"
    max_time_s: float | None = None  # a time budget: the position runs by time spent as well

    def __post_init__(self) -> None:
        if self.total_steps <= 0:
            raise EyasError(f"the schedule needs at least one step, got total_steps={self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise EyasError(f"warmup_steps must be in 0..{self.total_steps}, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise EyasError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.decay not in DECAYS:
            raise EyasError(f"learning-rate decay '{self.decay}' is not supported; accepted: "
                            f"{', '.join(DECAYS)}")
        if self.max_time_s is not None and not self.max_time_s > 0:
            raise EyasError(f"the time budget must be positive seconds, got {self.max_time_s}")

    def position(self, step: int, elapsed_s: float) -> float:
        """The schedule's position of optimizer step `step` taken after `elapsed_s` seconds of
        training: the step, or under a time budget the larger of it and the budget's share."""
        if self.max_time_s is None:
            return float(step)
        return max(float(step), self.total_steps * elapsed_s / self.max_time_s)

    def out_of_time(self, elapsed_s: float) -> bool:
        return self.max_time_s is not None and elapsed_s >= self.max_time_s

    def lr_at(self, step: float) -> float:
        """Learning rate at position `step` (0-based optimizer step, or `position()`)."""
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.base_lr
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        floor = self.min_lr_ratio * self.base_lr
        if self.decay == "linear":
            return self.base_lr + (floor - self.base_lr) * progress
        return floor + (self.base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: Optimizer, step: float) -> float:
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_state(self, state: dict[str, Any]) -> None:
        """A resumed run must continue the same schedule (checkpoints written before the decay
        could be chosen ran the cosine one)."""
        state = {"decay": "cosine", "max_time_s": None, **state}
        if state != self.state_dict():
            raise EyasError(f"the checkpoint's schedule {state} differs from this run's "
                            f"{self.state_dict()}; resume with the same settings")
