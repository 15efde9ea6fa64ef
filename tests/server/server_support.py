"""Servers started by the tests: the real app and engine on 127.0.0.1, a free port, a thread.
(A uniquely named module: test folders share one import namespace.)"""

from __future__ import annotations

from dataclasses import dataclass

import openai

from eyas.scheduler.config import EngineConfig
from eyas.scheduler.engine import Engine
from eyas.server.app import ServerSettings, create_app
from eyas.server.metrics import ServerMetrics
from eyas.server.runner import BackgroundServer


@dataclass
class Served:
    url: str
    name: str
    engine: Engine
    metrics: ServerMetrics
    server: BackgroundServer

    def client(self, api_key: str = "unused", **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=120, **options)


def start_server(target, name: str = "tiny", draft: str = "none", api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, **config) -> Served:
    options = {"max_running": 8, "speculation": "always", **config}
    metrics = ServerMetrics(name, num_positions=options.get("num_draft_tokens", 4))
    engine = Engine(target, EngineConfig(**options), draft=draft, observer=metrics)
    app = create_app(engine, ServerSettings(name, api_key=api_key, max_body_bytes=max_body_bytes),
                     metrics)
    server = BackgroundServer(app).start()
    return Served(server.url, name, engine, metrics, server)
