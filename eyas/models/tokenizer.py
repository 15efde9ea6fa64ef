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


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's own chat template.

    The template renders text (special tokens such as BOS included), which is then tokenized
    without adding special tokens a second time.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def raw_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of plain text (no chat template), with the tokenizer's usual special tokens."""
    return list(tokenizer(text)["input_ids"])
