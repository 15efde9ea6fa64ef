"""Support for the data tests: the fixtures folder, and SmolLM2's tokenizer with other chat templates."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATES = FIXTURES / "templates"


def tokenizer_with_template(base: Any, template: str | None, bos: str | None = None, eos: str | None = None,
                            special: tuple[str, ...] = ()) -> Any:
    """A copy of `base` with `fixtures/templates/TEMPLATE.jinja` and that template's special tokens."""
    tokenizer = copy.deepcopy(base)
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    if bos:
        tokenizer.add_special_tokens({"bos_token": bos})
    if eos:
        tokenizer.add_special_tokens({"eos_token": eos})
    if template is not None:
        tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tokenizer

