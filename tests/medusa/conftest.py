"""Medusa tests run on one thread: these small models are fastest there, and a two-thread op
stalls whenever the second core is busy (see tests/training/conftest.py)."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
