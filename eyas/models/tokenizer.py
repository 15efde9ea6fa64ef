"""The target's tokenizer and chat template, loaded from a resolved model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas.models.registry import resolve_model


def load_tokenizer(spec: str | Path, cache: str | Path | None = None) -> Any:
    """Return the Hugging Face tokenizer (with its chat template) of a model spec or folder."""
    from transformers import AutoTokenizer

    folder = resolve_model(str(spec), cache)
    return AutoTokenizer.from_pretrained(folder)
