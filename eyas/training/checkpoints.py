"""Training checkpoints: everything `--resume` needs, one folder per step, written atomically.

    OUT/checkpoints/step-0000500/
        config.json, model.safetensors   the head (an eyas EAGLE-3 or Medusa folder: usable as it is)
        optimizer.pt                      AdamW state (our own file; loaded with weights_only=True)
        rng.safetensors                   torch CPU (and CUDA) generator states
        trainer_state.json                step, epoch, data position, schedule, python RNG,
                                          the result-affecting settings of the run
        manifest.json                     size and sha256 of the five files above, written last

A folder appears only complete (atomic rename), so a kill at any moment leaves the previous
checkpoint usable. Restoring checks every file against the manifest before reading it; `--resume`
takes the newest checkpoint that passes and reads cleanly, and says on stderr which ones it
skipped and why.

Usage:
    save_checkpoint(out, step, head, optimizer, state, keep=2)
    latest = find_latest_checkpoint(out)          # Path or None
    state = restore_checkpoint(latest, head, optimizer)
    found = restore_newest_checkpoint(out, head, optimizer)   # (folder, state) or None
"""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.optim import Optimizer

from eyas.eagle3.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_head_state, save_head
from eyas.eagle3.head import Eagle3Head
from eyas.errors import EyasError
from eyas.medusa.checkpoint import load_medusa_state, save_medusa
from eyas.medusa.head import MedusaHeads
from eyas.utils.integrity import read_safetensors, verify_files, write_manifest
from eyas.utils.io import atomic_dir, read_json

CHECKPOINTS_DIR = "checkpoints"
STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
RNG_NAME = "rng.safetensors"
STEP_PATTERN = re.compile(r"^step-(\d+)$")
CHECKPOINT_FILES = (CONFIG_NAME, WEIGHTS_NAME, OPTIMIZER_NAME, RNG_NAME, STATE_NAME)
STATE_KEYS = ("step", "python_rng", "schedule")


def checkpoint_dir(output: str | Path, step: int) -> Path:
    return Path(output) / CHECKPOINTS_DIR / f"step-{step:07d}"


def list_checkpoints(output: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of the checkpoint folders, oldest first (a folder only ever appears
    complete; whether its files are intact is checked when it is restored)."""
    root = Path(output) / CHECKPOINTS_DIR
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = STEP_PATTERN.match(child.name)
            if match and child.is_dir():
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
    state = read_safetensors(folder / WEIGHTS_NAME)
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
        write_manifest(tmp, CHECKPOINT_FILES)  # replaces the head's own two-file manifest
    for _, old in list_checkpoints(output)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def restore_checkpoint(folder: Path, head: Eagle3Head | MedusaHeads, optimizer: Optimizer
                       ) -> dict[str, Any]:
    """Load head weights, optimizer and RNG states from `folder`; return its trainer state.

    Every file is checked against the manifest and read before anything is changed, except
    that a head or optimizer state that does not fit raises after the head was loaded."""
    # 1. Integrity: each file present, of its recorded size and sha256.
    verify_files(folder, CHECKPOINT_FILES)
    # 2. Read everything; any parse failure names the file.
    state = read_json(folder / STATE_NAME)
    if not isinstance(state, dict) or any(key not in state for key in STATE_KEYS):
        raise EyasError(f"{folder / STATE_NAME} lacks keys: it must hold {', '.join(STATE_KEYS)}")
    match = STEP_PATTERN.match(folder.name)
    if match and int(match.group(1)) != state["step"]:
        raise EyasError(f"{folder / STATE_NAME} says step {state['step']}, its folder is "
                        f"{folder.name}")
    try:
        optimizer_state = torch.load(folder / OPTIMIZER_NAME, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: pickle, zip or torch errors
        raise EyasError(f"{folder / OPTIMIZER_NAME} cannot be read ({type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else 'no detail'})") from None
    rng = read_safetensors(folder / RNG_NAME)
    if "torch_cpu" not in rng:
        raise EyasError(f"{folder / RNG_NAME} holds no torch_cpu generator state")
    # 3. Apply.
    read_head_state(head, folder)
    try:
        optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError, TypeError) as error:
        raise EyasError(f"{folder}: optimizer state does not fit this head ({error})") from None
    torch.set_rng_state(rng["torch_cpu"])
    cuda_states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
    try:
        version, internal, gauss = state["python_rng"]
        random.setstate((version, tuple(internal), gauss))
    except (TypeError, ValueError) as error:
        raise EyasError(f"{folder / STATE_NAME}: python_rng is not a Python generator state "
                        f"({error})") from None
    return state


def restore_newest_checkpoint(output: str | Path, head: Eagle3Head | MedusaHeads,
                              optimizer: Optimizer, is_main: bool = True
                              ) -> tuple[Path, dict[str, Any]] | None:
    """Restore the newest checkpoint of `output` that verifies; None when there is none at all.

    A checkpoint that fails (a changed, truncated or missing file, a state that does not parse)
    is skipped with a line on stderr and, once an older one is restored, renamed to
    `step-N.unusable` so that it is neither resumed nor kept in place of a good one (rank 0
    only: `is_main`). If every one fails, EyasError lists why."""
    failures: list[tuple[Path, str]] = []
    newest_first = [folder for _, folder in reversed(list_checkpoints(output))]
    for number, folder in enumerate(newest_first):
        try:
            state = restore_checkpoint(folder, head, optimizer)
        except EyasError as error:
            failures.append((folder, str(error)))
            if is_main:
                following = (f"falling back to {newest_first[number + 1].name}"
                             if number + 1 < len(newest_first) else "no older checkpoint")
                print(f"[eyas] warning: checkpoint {folder.name} is unusable: {error}; {following}",
                      file=sys.stderr, flush=True)
            continue
        if is_main:
            for bad, _ in failures:
                aside = bad.with_name(bad.name + ".unusable")
                shutil.rmtree(aside, ignore_errors=True)
                bad.rename(aside)
                print(f"[eyas] moved the unusable checkpoint aside to {aside}", file=sys.stderr,
                      flush=True)
        return folder, state
    if failures:
        reasons = "; ".join(f"{folder.name}: {reason}" for folder, reason in failures)
        raise EyasError(f"cannot resume: no checkpoint in {Path(output) / CHECKPOINTS_DIR} verifies "
                        f"({reasons}); remove them to start over, or use a new --out")
    return None


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
