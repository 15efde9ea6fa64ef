"""A 2-process torchrun DDP run on CPU (gloo) equals one process at the same global batch."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas.bench.lmeval.compare import free_port
from eyas.training.config import TrainConfig
from eyas.training.trainer import Trainer

STEPS = 3


def train_losses(folder: Path) -> list[float]:
    with open(folder / "metrics.csv") as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle) if row["split"] == "train"]


def test_two_ranks_equal_one_process(tmp_path, tiny_target_dir, tokenized_file) -> None:
    common = ["--model", str(tiny_target_dir), "--data", str(tokenized_file), "--draft-vocab-size", "64",
              "--ttt-steps", "3", "--max-steps", str(STEPS), "--log-every", "1", "--lr", "1e-3",
              "--no-progress"]
    # 2 ranks x micro batch 2 x accumulation 1 = global batch 4
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "eyas.cli.train",
               *common, "--out", str(tmp_path / "ddp"), "--micro-batch-size", "2"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]  # how far the ranks got, too
    assert "2 rank(s)" in done.stdout
    # 1 process x micro batch 2 x accumulation 2 = global batch 4
    single = TrainConfig(model=str(tiny_target_dir), data=str(tokenized_file), output=str(tmp_path / "single"),
                         draft_vocab_size=64, ttt_steps=3, max_steps=STEPS, log_every=1, learning_rate=1e-3,
                         micro_batch_size=2, grad_accum=2, progress=False)
    Trainer(single).train()
    ddp_losses, single_losses = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "single")
    assert len(ddp_losses) == STEPS
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ddp_losses, single_losses)), (ddp_losses, single_losses)
    ddp_head = load_file(str(tmp_path / "ddp" / "head" / "model.safetensors"))
    single_head = load_file(str(tmp_path / "single" / "head" / "model.safetensors"))
    assert ddp_head.keys() == single_head.keys()
    for name in ddp_head:
        assert torch.allclose(ddp_head[name].float(), single_head[name].float(), atol=1e-6, rtol=1e-5), name
