"""The HTTP implementation and event loop uvicorn serves with: httptools and uvloop where they
are installed (less of the event loop's CPU a streamed token), h11 and asyncio when asked."""

from __future__ import annotations

import importlib.util

import pytest
from fastapi import FastAPI

from eyas.server.runner import uvicorn_config


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_auto_takes_httptools_and_uvloop_where_installed():
    config = uvicorn_config(FastAPI(), "127.0.0.1", 0)
    config.load()
    expected = "HttpToolsProtocol" if installed("httptools") else "H11Protocol"
    assert config.http_protocol_class.__name__ == expected
    loop = config.get_loop_factory()()
    try:
        assert type(loop).__module__.split(".")[0] == ("uvloop" if installed("uvloop") else "asyncio")
    finally:
        loop.close()


@pytest.mark.parametrize("http, loop_name, protocol, loop_module", [
    ("h11", "asyncio", "H11Protocol", "asyncio"),
    ("httptools", "uvloop", "HttpToolsProtocol", "uvloop"),
])
def test_an_implementation_named_is_the_one_served(http, loop_name, protocol, loop_module):
    for module in (http, loop_name):
        if module != "asyncio":
            pytest.importorskip(module)
    config = uvicorn_config(FastAPI(), "127.0.0.1", 0, http=http, loop=loop_name)
    config.load()
    assert config.http_protocol_class.__name__ == protocol
    loop = config.get_loop_factory()()
    try:
        assert type(loop).__module__.split(".")[0] == loop_module
    finally:
        loop.close()
