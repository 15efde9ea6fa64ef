"""Where a model's weights come from: safetensors files or a GGUF, read one tensor at a time.

A resolved model folder (models/registry.py) holds either the weights (a Hugging Face folder:
*.safetensors) or, for a GGUF, only config.json, the tokenizer and eyas_source.json, which names
the GGUF file the weights are read from. `open_weights` returns the one reader both loaders use
(engine/layerwise.py): `names()` and `get(name)`, each tensor read when asked for.

Usage:
    source = open_weights(folder)
    embedding = source.get("model.embed_tokens.weight")   # [V, H], the checkpoint's dtype
    source.files()                                         # what the int4 cache is keyed by
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Protocol

from torch import Tensor

from eyas.errors import EyasError

SOURCE_INFO = "eyas_source.json"  # in a folder resolved from a GGUF: {"gguf": path, ...}


class WeightSource(Protocol):
    def names(self) -> set[str]: ...

    def get(self, name: str) -> Tensor: ...

    def files(self) -> list[Path]: ...


class SafetensorsSource:
    """The tensors of a folder's *.safetensors files, each read from its file when asked for
    (plain reads, not a memory map: pages of a map that was read once would stay counted in
    the process's resident memory)."""

    def __init__(self, folder: Path) -> None:
        from eyas.models.int4_cache import read_header

        self.paths = [Path(file) for file in sorted(glob.glob(str(folder / "*.safetensors")))]
        if not self.paths:
            raise EyasError(f"no *.safetensors weights in {folder} (pickled .bin files are not loaded)")
        self.where: dict[str, tuple[Path, int, dict]] = {}
        for path in self.paths:
            base, header = read_header(path)
            for name, entry in header.items():
                if name != "__metadata__":
                    self.where[name] = (path, base, entry)

    def names(self) -> set[str]:
        return set(self.where)

    def get(self, name: str) -> Tensor:
        from eyas.models.int4_cache import read_tensor

        if name not in self.where:
            raise EyasError(f"no tensor {name} in the safetensors files of {self.paths[0].parent}")
        path, base, entry = self.where[name]
        return read_tensor(path, base, entry)

    def files(self) -> list[Path]:
        return list(self.paths)


def gguf_file(folder: Path) -> Path | None:
    """The GGUF a resolved folder reads its weights from, or None for a Hugging Face folder."""
    info = folder / SOURCE_INFO
    if not info.is_file():
        return None
    path = json.loads(info.read_text()).get("gguf")
    if path is None or (folder / "model.safetensors").is_file():
        return None  # a folder converted by an older eyas: it holds float32 weights itself
    if not Path(path).is_file():
        raise EyasError(f"{folder} reads its weights from {path}, which is gone; "
                        f"load the GGUF again by its new path")
    return Path(path)


def open_weights(folder: Path, heads: int | None = None, kv_heads: int | None = None) -> WeightSource:
    """The weights of a resolved model folder, read tensor by tensor."""
    path = gguf_file(folder)
    if path is not None:
        from eyas.models.gguf_loader import GGUFSource

        return GGUFSource(path, heads=heads, kv_heads=kv_heads)
    return SafetensorsSource(folder)
