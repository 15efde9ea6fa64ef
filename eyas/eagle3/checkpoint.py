"""The eyas head checkpoint: a folder with `config.json`, `model.safetensors`, `manifest.json`.

    config.json        Eagle3Config.to_dict(): our own keys, target_layer_ids in boundary ids
    model.safetensors  fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t (int64), t2d (bool)
                       and embed_tokens.weight only when saved with include_embedding=True
    manifest.json      size and sha256 of the two files (utils/integrity.py), written last

Loading checks both files against the manifest first (a head without one, written by an older
eyas, loads with a warning) and reads safetensors only (never pickles).

Usage:
    save_head(head, "runs/smollm2/head")
    head = load_head("runs/smollm2/head", embedding=target.model.embed_tokens.weight)
    config = read_head_config("runs/smollm2/head")
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from eyas.eagle3.config import Eagle3Config
from eyas.eagle3.head import Eagle3Head
from eyas.errors import EyasError
from eyas.utils.integrity import read_safetensors, verify_files, write_manifest
from eyas.utils.io import atomic_path, read_json, write_json_atomic
from eyas.utils.state import check_state, copy_state

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
EMBEDDING_NAME = "embed_tokens.weight"


def head_state_dict(head: Eagle3Head, include_embedding: bool = False,
                    dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The head's tensors by checkpoint name; float weights cast to `dtype` when given."""
    state = {}
    for name, tensor in head.state_dict().items():
        if name == EMBEDDING_NAME and not include_embedding:
            continue
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous()
    return state


def save_head(head: Eagle3Head, folder: str | Path, include_embedding: bool = False,
              dtype: torch.dtype | None = None) -> Path:
    """Write config.json, model.safetensors and (last) their manifest into `folder`, each file
    atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / WEIGHTS_NAME) as tmp:
        save_file(head_state_dict(head, include_embedding, dtype), str(tmp),
                  metadata={"format": "pt", "producer": "eyas"})
    write_json_atomic(folder / CONFIG_NAME, head.config.to_dict())
    write_manifest(folder, [CONFIG_NAME, WEIGHTS_NAME])
    return folder


def read_head_config(folder: str | Path, verify: bool = True) -> Eagle3Config:
    """The config of a head folder (checked against the folder's manifest unless `verify` is
    False, for a caller that has just verified it)."""
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise EyasError(f"{folder} is not an eyas head: no {CONFIG_NAME} (expected the folder "
                        f"that `eyas train` wrote, e.g. OUT/head)")
    if verify:
        verify_files(folder, [CONFIG_NAME])
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise EyasError(f"{path} is not a head config (a JSON object expected)")
    return Eagle3Config.from_dict(raw)


def load_head_state(head: Eagle3Head, state: dict[str, Tensor], source: str) -> None:
    """Load `state` into `head`, strictly except for the optional embedding."""
    check_state(head.state_dict(), state, source, "the head", optional={EMBEDDING_NAME})
    state = dict(state)
    if EMBEDDING_NAME in state:
        head.set_embedding(state.pop(EMBEDDING_NAME).to(head.dtype))
    copy_state(head, state)  # d2t and t2d become int64 and bool, the buffers' dtypes


def load_head(folder: str | Path, embedding: Tensor | None = None, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Build the head of an eyas checkpoint folder; share `embedding` [V, H] when given."""
    folder = Path(folder)
    if not (folder / CONFIG_NAME).is_file():
        read_head_config(folder)  # raises: not a head folder
    if not (folder / WEIGHTS_NAME).is_file():
        raise EyasError(f"{folder} has no {WEIGHTS_NAME}")
    verify_files(folder, [CONFIG_NAME, WEIGHTS_NAME])
    config = read_head_config(folder, verify=False)
    weights = folder / WEIGHTS_NAME
    head = Eagle3Head(config)
    load_head_state(head, read_safetensors(weights), str(weights))
    head = head.to(device=device, dtype=dtype)
    if embedding is not None:
        head.set_embedding(embedding.to(device=device, dtype=dtype))
    return head.eval()
