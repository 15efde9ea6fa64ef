"""Run the app: the way `eyas serve` does (uvicorn on a thread, the engine on the main
thread), or entirely on background threads (tests, benchmarks, notebooks).

Usage:
    serve_with_engine(app, engine, host="127.0.0.1", port=8000, drain_timeout=30)  # blocks; SIGTERM drains
    with BackgroundServer(app) as server:                        # 127.0.0.1, a free port
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")

Why the engine gets the main thread: the model was loaded there, and torch's small ops run
about 2x slower on a second thread that also uses OpenMP (see eyas/scheduler/loop.py).

SIGTERM (and Ctrl-C): uvicorn stops accepting connections, waits for the open ones (requests
in flight, streams included) to complete, then runs the app's shutdown, which drains the
engine; the engine loop returns and the process exits with status 0. Requests still running
`drain_timeout` seconds after the signal are aborted: each answer and stream ends with
finish_reason "abort" (a stream: its final chunk, then [DONE]), so that no client is left
with a cut connection. A second Ctrl-C stops without waiting.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from eyas.errors import EyasError

if TYPE_CHECKING:
    from eyas.scheduler.engine import Engine

log = logging.getLogger("eyas.serve")


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str = "info",
                   http: str = "auto", loop: str = "auto") -> uvicorn.Config:
    """http, loop: uvicorn's HTTP/1.1 implementation (h11, httptools) and event loop (asyncio,
    uvloop); auto takes httptools and uvloop where they are installed."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=None, lifespan="on", http=http, loop=loop)


def serve_with_engine(app: FastAPI, engine: Engine, host: str = "127.0.0.1", port: int = 8000,
                      log_level: str = "info", drain_timeout: float | None = None) -> None:
    """uvicorn on a background thread; `engine.run()` on this (the main) thread.
    drain_timeout: seconds after SIGTERM/Ctrl-C before running requests are aborted (None:
    wait for them all)."""
    server = BackgroundServer(app, host, port, log_level)
    deadline: list[threading.Timer] = []

    def drain_expired() -> None:
        aborted = engine.abort_all()
        if aborted:
            log.warning("drain timeout (%.0f s): aborted %d running requests", drain_timeout, aborted)

    def on_signal(signum, frame) -> None:
        if server.server.should_exit and signum == signal.SIGINT:
            server.server.force_exit = True  # a second Ctrl-C: stop without waiting
        server.server.should_exit = True  # graceful: connections finish, then the app shuts down
        if drain_timeout is not None and not deadline:
            log.info("shutting down: running requests get %.0f s to finish", drain_timeout)
            deadline.append(threading.Timer(drain_timeout, drain_expired))
            deadline[0].daemon = True
            deadline[0].start()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server.start()
        except RuntimeError as error:
            raise EyasError(f"could not serve on {host}:{port} (in use? no permission?)") from error
        # Returns once the app's shutdown has drained the engine (or the HTTP thread died).
        engine.run(stop_when=lambda: not server.thread.is_alive())
        server.thread.join()
    finally:
        for timer in deadline:
            timer.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class BackgroundServer:
    """uvicorn on a daemon thread, bound to 127.0.0.1 on a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None,
                 log_level: str = "warning", http: str = "auto", loop: str = "auto") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port, log_level, http, loop))
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
