"""Shared fixtures of the data tests: fixture paths and the SmolLM2 tokenizer with other templates."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    from eyas.errors import EyasError
    from eyas.models.tokenizer import load_tokenizer

    try:
        return load_tokenizer("smollm2-135m")
    except EyasError as error:  # the package that carries the model is missing
        pytest.skip(str(error))


def tokenizer_with_template(base: Any, template: str | None, bos: str | None = None, eos: str | None = None,
                            special: tuple[str, ...] = ()) -> Any:
    """SmolLM2's tokenizer with another chat template (and that template's special tokens added)."""
    tokenizer = copy.deepcopy(base)
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    if bos:
        tokenizer.add_special_tokens({"bos_token": bos})
    if eos:
        tokenizer.add_special_tokens({"eos_token": eos})
    if template is not None:
        tokenizer.chat_template = (FIXTURES / "templates" / f"{template}.jinja").read_text()
    return tokenizer
