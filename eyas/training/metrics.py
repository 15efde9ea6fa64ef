"""Training metrics: the acceptance-length estimate, a CSV log, TensorBoard when installed.

    accept_length = 1 + sum_k prod_{i<=k} acc_i      (includes the bonus token)

Usage:
    logger = MetricsLogger("runs/x", ttt_steps=7, resume_step=None)
    logger.log({"step": 10, "split": "train", "loss": 2.3, "acc_0": 0.4, ...})
    logger.close()
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Sequence

from eyas.utils.io import atomic_path

CSV_NAME = "metrics.csv"


def acceptance_length(accuracies: Sequence[float]) -> float:
    """Expected tokens per verification of a chain drafted with these per-step accuracies."""
    total, survive = 1.0, 1.0
    for accuracy in accuracies:
        survive *= accuracy
        total += survive
    return total


def metric_columns(ttt_steps: int) -> list[str]:
    return (["step", "split", "epoch", "lr", "loss", "accept_length", "grad_norm", "tokens",
             "tokens_per_s", "elapsed_s"]
            + [f"loss_{k}" for k in range(ttt_steps)] + [f"acc_{k}" for k in range(ttt_steps)])


class MetricsLogger:
    """Appends rows to OUT/metrics.csv; a resumed run first drops rows after its checkpoint."""

    def __init__(self, folder: str | Path, ttt_steps: int, resume_step: int | None,
                 enabled: bool = True, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.columns = metric_columns(ttt_steps)
        self.path = Path(folder) / CSV_NAME
        self.writer = None
        if not enabled:
            return
        kept: list[dict[str, str]] = []
        if resume_step is not None and self.path.is_file():
            with open(self.path, newline="") as handle:
                kept = [row for row in csv.DictReader(handle) if int(row["step"]) <= resume_step]
        buffer = io.StringIO()
        table = csv.DictWriter(buffer, fieldnames=self.columns, extrasaction="ignore")
        table.writeheader()
        table.writerows(kept)
        with atomic_path(self.path) as tmp:
            tmp.write_text(buffer.getvalue())
        self.handle = open(self.path, "a", newline="")
        self.table = csv.DictWriter(self.handle, fieldnames=self.columns, extrasaction="ignore")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            except ImportError:
                SummaryWriter = None  # optional: the CSV has everything
            if SummaryWriter is not None:
                self.writer = SummaryWriter(str(Path(folder) / "tensorboard"))

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.table.writerow({k: _format(v) for k, v in row.items()})
        self.handle.flush()
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self.writer.add_scalar(f"{row['split']}/{key}", value, row["step"])

    def close(self) -> None:
        if self.enabled:
            self.handle.close()
            if self.writer is not None:
                self.writer.close()


def _format(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value
