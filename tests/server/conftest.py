"""Module-scoped tiny servers shared by the server tests (see server_support.py)."""

from __future__ import annotations

import pytest

from server_support import start_server


@pytest.fixture(scope="module")
def tiny_server(tiny_target):
    served = start_server(tiny_target, draft="ngram:3,1,3")
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def tiny_plain_server(tiny_target):
    served = start_server(tiny_target, draft="none")
    yield served
    served.server.stop()
