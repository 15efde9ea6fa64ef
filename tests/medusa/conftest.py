"""Medusa tests run on one thread: these small models are fastest there, and a two-thread op
stalls whenever the second core is busy (see tests/training/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def single_threaded(one_thread) -> None:
    """Every Medusa test runs on one thread (tests/conftest.py)."""
