"""The eyas Medusa checkpoint: a folder with `config.json`, `model.safetensors`, `manifest.json`.

    config.json        MedusaConfig.to_dict() (format "eyas-medusa")
    model.safetensors  blocks.{k}.{j}.linear.weight/bias for head k, block j; with a draft
                       vocabulary also lm_head.weight, d2t (int64), t2d (bool). Heads that share
                       the target's output layer store none of it.
    manifest.json      size and sha256 of the two files (utils/integrity.py), written last

Loading checks both files against the manifest first (a folder without one, written by an older
eyas, loads with a warning) and reads safetensors only (never pickles).

Usage:
    save_medusa(heads, "runs/medusa/head")
    heads = load_medusa("runs/medusa/head", device="cpu", dtype=torch.float32)
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from eyas.errors import EyasError
from eyas.medusa.config import MedusaConfig
from eyas.medusa.head import MedusaHeads
from eyas.utils.integrity import read_safetensors, verify_files, write_manifest
from eyas.utils.io import atomic_path, read_json, write_json_atomic
from eyas.utils.state import check_state, copy_state

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def medusa_state_dict(heads: MedusaHeads) -> dict[str, Tensor]:
    """The tensors a checkpoint holds (never a shared target output layer)."""
    state = {}
    for name, tensor in heads.state_dict().items():
        if heads.config.shares_target_output and name.startswith("lm_head."):
            continue
        state[name] = tensor.detach().cpu().contiguous()
    return state


def save_medusa(heads: MedusaHeads, folder: str | Path) -> Path:
    """Write config.json, model.safetensors and (last) their manifest into `folder`, each file
    atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / WEIGHTS_NAME) as tmp:
        save_file(medusa_state_dict(heads), str(tmp), metadata={"format": "pt", "producer": "eyas"})
    write_json_atomic(folder / CONFIG_NAME, heads.config.to_dict())
    write_manifest(folder, [CONFIG_NAME, WEIGHTS_NAME])
    return folder


def read_medusa_config(folder: str | Path, verify: bool = True) -> MedusaConfig:
    """The config of a Medusa folder (checked against its manifest unless `verify` is False)."""
    path = Path(folder) / CONFIG_NAME
    if not Path(folder).is_dir():
        raise EyasError(f"no Medusa heads at {folder}: no such folder (expected OUT/head of "
                        f"`eyas train --method medusa`)")
    if not path.is_file():
        raise EyasError(f"{folder} holds no Medusa heads: no {CONFIG_NAME} (expected OUT/head of "
                        f"`eyas train --method medusa`)")
    if verify:
        verify_files(folder, [CONFIG_NAME])
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise EyasError(f"{path} is not a Medusa config (a JSON object expected)")
    return MedusaConfig.from_dict(raw)


def load_medusa_state(heads: MedusaHeads, state: dict[str, Tensor], source: str) -> None:
    """Load `state` into `heads` strictly (a shared output layer is never in a checkpoint)."""
    check_state(medusa_state_dict(heads), state, source, "the heads")
    copy_state(heads, state)


def load_medusa(folder: str | Path, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """Build the heads of an eyas Medusa folder (call set_output_layer when they share it)."""
    folder = Path(folder)
    if not (folder / CONFIG_NAME).is_file():
        read_medusa_config(folder)  # raises: no such folder, or no heads in it
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise EyasError(f"{folder} has no {WEIGHTS_NAME}")
    verify_files(folder, [CONFIG_NAME, WEIGHTS_NAME])
    config = read_medusa_config(folder, verify=False)
    heads = MedusaHeads(config)
    load_medusa_state(heads, read_safetensors(weights), str(weights))
    return heads.to(device=device, dtype=dtype).eval()
