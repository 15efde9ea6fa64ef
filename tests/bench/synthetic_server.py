"""A synthetic OpenAI-compatible streaming server with known delays, for the benchmark tests.

In a thread (tests):
    with SyntheticServer(Behaviour(ttft_ms=50, itl_ms=20, tokens=12)) as server:
        server.url  # http://127.0.0.1:PORT

As a process, with the flags of `eyas serve` (the stand-in that `eyas bench compare` starts):
    python tests/bench/synthetic_server.py --model m --draft ngram --host 127.0.0.1 --port 8123

Every request streams: a role-only chunk at once, the first content chunk (1 token) after
`ttft_ms`, then chunks of `tokens_per_chunk` tokens every `itl_ms` (plus `itl_per_active_ms`
per other request in flight, to mimic a batch that slows down), then the usage chunk and
`[DONE]`. Token i is the text " w{i}", so a whitespace split counts tokens exactly. With
speculative counters on, each chunk after the first is one draft of `draft_len` tokens of which
`tokens_per_chunk - 1` were accepted (positions 0 .. tokens_per_chunk - 2): the acceptance
length is exactly `tokens_per_chunk`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


@dataclass
class Behaviour:
    ttft_ms: float = 50.0
    itl_ms: float = 20.0  # between content chunks
    itl_per_active_ms: float = 0.0  # added per other request in flight
    tokens: int = 12  # output tokens per request (capped by max_tokens)
    tokens_per_chunk: int = 1  # after the first chunk, which carries one token
    draft_len: int = 4
    spec_metrics: bool = False  # expose vllm:spec_decode_* counters
    metrics_endpoint: bool = True  # False: /metrics answers 404
    usage: bool = True  # send the usage chunk
    model: str = "synthetic-model"


@dataclass
class Counters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: dict[int, int] = field(default_factory=dict)
    active: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)


def prompt_words(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    return len(str(body.get("prompt", "")).split())


def metrics_text(behaviour: Behaviour, counters: Counters) -> str:
    lines = ["# TYPE synthetic_requests_running gauge", f"synthetic_requests_running {counters.active}"]
    if behaviour.spec_metrics:
        labels = f'engine="0",model_name="{behaviour.model}"'
        for name, value in (("num_drafts", counters.drafts), ("num_draft_tokens", counters.draft_tokens),
                            ("num_accepted_tokens", counters.accepted)):
            lines += [f"# TYPE vllm:spec_decode_{name} counter",
                      f"vllm:spec_decode_{name}_total{{{labels}}} {float(value)}"]
        lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
        for position in range(behaviour.draft_len):
            value = float(counters.accepted_per_position.get(position, 0))
            lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},'
                         f'position="{position}"}} {value}')
    return "\n".join(lines) + "\n"


def build_app(behaviour: Behaviour, counters: Counters) -> FastAPI:
    app = FastAPI()

    def chunk(body: dict[str, Any], chat: bool, text: str | None, usage: dict | None) -> str:
        if text is None:
            choices = []
        elif chat:
            choices = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
        else:
            choices = [{"index": 0, "text": text, "finish_reason": None}]
        payload = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                   "model": body.get("model"), "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    async def stream(body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        counters.active += 1
        try:
            total = min(behaviour.tokens, int(body.get("max_tokens") or behaviour.tokens))
            continuous = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
            prompt_tokens = prompt_words(body)
            if chat:
                yield ("data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant",
                       "content": ""}}], "model": body.get("model")}) + "\n\n")
            await asyncio.sleep(behaviour.ttft_ms / 1000)
            sent = 0
            while sent < total:
                size = 1 if sent == 0 else min(behaviour.tokens_per_chunk, total - sent)
                if sent > 0:
                    others = max(0, counters.active - 1)
                    await asyncio.sleep((behaviour.itl_ms + behaviour.itl_per_active_ms * others) / 1000)
                    counters.drafts += 1
                    counters.draft_tokens += behaviour.draft_len
                    counters.accepted += size - 1
                    per_position = counters.accepted_per_position
                    for position in range(size - 1):
                        per_position[position] = per_position.get(position, 0) + 1
                text = "".join(f" w{sent + i}" for i in range(size))
                sent += size
                usage = ({"prompt_tokens": prompt_tokens, "completion_tokens": sent}
                         if continuous else None)
                yield chunk(body, chat, text, usage)
            if behaviour.usage:
                yield chunk(body, chat, None, {"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                                               "total_tokens": prompt_tokens + sent})
            yield "data: [DONE]\n\n"
        finally:
            counters.active -= 1

    async def complete(request: Request, chat: bool) -> Any:
        body = await request.json()
        counters.requests.append(body)
        if body.get("model") != behaviour.model:
            return JSONResponse({"error": {"message": f"model '{body.get('model')}' not found"}},
                                status_code=404)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": behaviour.model, "object": "model"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Any:
        if not behaviour.metrics_endpoint:
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(metrics_text(behaviour, counters))

    return app


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SyntheticServer:
    """The synthetic server in a daemon thread on a free 127.0.0.1 port."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.counters = Counters()
        self.port = free_port()
        config = uvicorn.Config(build_app(behaviour, self.counters), host="127.0.0.1",
                                port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> SyntheticServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("synthetic server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic-model")
    parser.add_argument("--draft", default="none",
                        help="none: plain; fail: exit at once (a broken server); else speculative")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--itl-per-active-ms", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--spec-tokens-per-chunk", type=int, default=3)
    args = parser.parse_args()
    if args.draft == "fail":
        raise SystemExit("synthetic server: draft 'fail' asked for a failed start")
    speculative = args.draft != "none"
    behaviour = Behaviour(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms,
                          itl_per_active_ms=args.itl_per_active_ms, tokens=args.tokens,
                          tokens_per_chunk=args.spec_tokens_per_chunk if speculative else 1,
                          spec_metrics=speculative, model=args.model)
    uvicorn.run(build_app(behaviour, Counters()), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
