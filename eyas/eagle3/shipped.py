"""Heads shipped inside the eyas package, by name: `--draft eagle3:smollm2-135m`.

Usage:
    from eyas.eagle3.shipped import shipped_head_dir
    shipped_head_dir("smollm2-135m")   # Path to eyas/assets/heads/smollm2-135m, or None

How each was trained (data, commands, time) is in docs/training.md, "The shipped head".
"""

from __future__ import annotations

from pathlib import Path

HEADS_DIR = Path(__file__).resolve().parent.parent / "assets" / "heads"

# head name (the target's alias) -> folder under eyas/assets/heads
SHIPPED_HEADS: dict[str, str] = {"smollm2-135m": "smollm2-135m"}


def shipped_head_dir(name: str) -> Path | None:
    """The folder of the head shipped under `name`, or None when there is none (or its files
    are missing from this installation)."""
    folder = SHIPPED_HEADS.get(name)
    if folder is None:
        return None
    path = HEADS_DIR / folder
    return path if (path / "config.json").is_file() and (path / "model.safetensors").is_file() else None
