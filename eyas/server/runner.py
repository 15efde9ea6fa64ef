"""Run the app: in the foreground (the CLI; SIGTERM drains) or on a background thread (tests,
benchmarks, notebooks).

Usage:
    run_server(app, host="127.0.0.1", port=8000)                 # blocks; Ctrl-C / SIGTERM stop it
    with BackgroundServer(app) as server:                        # 127.0.0.1, a free port
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")

SIGTERM (and Ctrl-C): uvicorn stops accepting connections, waits for the open ones (requests
in flight, streams included) to complete, then runs the app's shutdown, which drains the
engine; the process then exits with status 0.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=None, lifespan="on")


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until SIGTERM or Ctrl-C; returns normally after a graceful SIGTERM shutdown."""
    # uvicorn handles the signal (drain, shutdown), then raises it again under the handler that
    # was in place before: with this no-op one, a drained SIGTERM ends in exit status 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.Server(uvicorn_config(app, host, port, log_level)).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class BackgroundServer:
    """uvicorn on a daemon thread, bound to 127.0.0.1 on a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None,
                 log_level: str = "warning") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port, log_level))
        self.thread = threading.Thread(target=self.server.run, name="eyas-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
