"""Training checkpoints: everything `--resume` needs, one folder per step, written atomically.

    OUT/checkpoints/step-0000500/
        config.json, model.safetensors   the head (an eyas EAGLE-3 or Medusa folder: usable as it is)
        optimizer.pt                      AdamW state (our own file; loaded with weights_only=True)
        rng.safetensors                   torch CPU (and CUDA) generator states
        trainer_state.json                step, epoch, data position, schedule, python RNG,
                                          the result-affecting settings of the run

A folder appears only complete (atomic rename), so a kill at any moment leaves the previous
checkpoint usable.

Usage:
    save_checkpoint(out, step, head, optimizer, state)
    latest = find_latest_checkpoint(out)          # Path or None
    state = restore_checkpoint(latest, head, optimizer)
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.optim import Optimizer

from eyas.eagle3.checkpoint import WEIGHTS_NAME, load_head_state, save_head
from eyas.eagle3.head import Eagle3Head
from eyas.errors import EyasError
from eyas.medusa.checkpoint import load_medusa_state, save_medusa
from eyas.medusa.head import MedusaHeads
from eyas.utils.io import atomic_dir

CHECKPOINTS_DIR = "checkpoints"
STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
RNG_NAME = "rng.safetensors"
STEP_PATTERN = re.compile(r"^step-(\d+)$")


def checkpoint_dir(output: str | Path, step: int) -> Path:
    return Path(output) / CHECKPOINTS_DIR / f"step-{step:07d}"


def list_checkpoints(output: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of complete checkpoints, oldest first."""
    root = Path(output) / CHECKPOINTS_DIR
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = STEP_PATTERN.match(child.name)
            if match and (child / STATE_NAME).is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def find_latest_checkpoint(output: str | Path) -> Path | None:
    found = list_checkpoints(output)
    return found[-1][1] if found else None


def _rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = state
    return tensors


def write_head(head: Eagle3Head | MedusaHeads, folder: str | Path) -> None:
    """The head folder of either method (config.json + model.safetensors)."""
    if isinstance(head, MedusaHeads):
        save_medusa(head, folder)
    else:
        save_head(head, folder)


def read_head_state(head: Eagle3Head | MedusaHeads, folder: Path) -> None:
    state = load_file(str(folder / WEIGHTS_NAME))
    if isinstance(head, MedusaHeads):
        load_medusa_state(head, state, str(folder))
    else:
        load_head_state(head, state, str(folder))


def save_checkpoint(output: str | Path, step: int, head: Eagle3Head | MedusaHeads, optimizer: Optimizer,
                    state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `step` atomically, then drop all but the newest `keep`."""
    folder = checkpoint_dir(output, step)
    if folder.exists():  # the same step again (e.g. the final save right after a periodic one)
        shutil.rmtree(folder)
    with atomic_dir(folder) as tmp:
        write_head(head, tmp)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_NAME)
        save_file(_rng_tensors(), str(tmp / RNG_NAME))
        python_state = random.getstate()
        full_state = {**state, "step": step,
                      "python_rng": [python_state[0], list(python_state[1]), python_state[2]]}
        (tmp / STATE_NAME).write_text(json.dumps(full_state, indent=2) + "\n")
    for _, old in list_checkpoints(output)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def restore_checkpoint(folder: Path, head: Eagle3Head | MedusaHeads, optimizer: Optimizer
                       ) -> dict[str, Any]:
    """Load head weights, optimizer and RNG states from `folder`; return its trainer state."""
    state = json.loads((folder / STATE_NAME).read_text())
    read_head_state(head, folder)
    optimizer_state = torch.load(folder / OPTIMIZER_NAME, map_location="cpu", weights_only=True)
    try:
        optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError) as error:
        raise EyasError(f"{folder}: optimizer state does not fit this head ({error})") from None
    rng = load_file(str(folder / RNG_NAME))
    torch.set_rng_state(rng["torch_cpu"])
    cuda_states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    return state


def check_resume_settings(state: dict[str, Any], settings: dict[str, Any], global_batch: int) -> None:
    """Refuse to resume with settings that would change the result."""
    saved = state.get("settings", {})
    changed = sorted(k for k in settings if saved.get(k) != settings[k])
    if state.get("global_batch") != global_batch:
        changed.append(f"global_batch ({state.get('global_batch')} -> {global_batch})")
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {settings[k]!r}" if k in settings else k
                            for k in changed)
        raise EyasError(f"cannot resume: settings differ from the checkpoint's ({details}); use the "
                        f"same settings, or a new --out folder to start over")
