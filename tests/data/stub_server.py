"""A small OpenAI-compatible server for the regeneration tests, run in a thread on 127.0.0.1.

It answers `/v1/chat/completions` with a deterministic text built from the request (so a test
can check that turn 2 was asked on the regenerated turn 1), and can be told to fail: after
`fail_after` answers it returns HTTP `fail_status` (or hangs past the client's timeout).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse


@dataclass
class StubState:
    fail_after: int | None = None  # answers served before it starts failing
    fail_status: int = 503
    hang_seconds: float = 0.0  # with fail_status == 0: sleep instead of answering
    answered: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)


def answer_text(messages: list[dict[str, str]]) -> str:
    turn = sum(message["role"] == "user" for message in messages)
    previous = [m["content"] for m in messages if m["role"] == "assistant"]
    return f"answer {turn} to '{messages[-1]['content']}' after {previous}"


def build_app(state: StubState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict[str, Any]) -> Any:
        state.requests.append(body)
        if state.fail_after is not None and state.answered >= state.fail_after:
            if state.fail_status == 0:
                time.sleep(state.hang_seconds)
            return JSONResponse({"error": {"message": "stub failure"}}, status_code=state.fail_status or 503)
        if body["messages"][-1]["content"] == "REJECT ME":
            return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)
        state.answered += 1
        text = answer_text(body["messages"])
        return {
            "id": f"cmpl-{state.answered}", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": len(text.split()), "total_tokens": 10},
        }

    return app


class StubServer:
    def __init__(self, state: StubState) -> None:
        self.state = state
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = uvicorn.Config(build_app(state), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> StubServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stub server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
