"""The OpenAI-compatible HTTP server (FastAPI) in front of the serving engine.

Usage:
    from eyas.server.app import ServerSettings, create_app
    app = create_app(engine, ServerSettings(model_name="smollm2-135m"), ServerMetrics("smollm2-135m"))
    uvicorn.run(app, host="127.0.0.1", port=8000)        # or: eyas serve --model ...

Routes: POST /v1/chat/completions, POST /v1/completions (streaming as SSE `data: {...}` lines
ending with `data: [DONE]`, or one JSON body), GET /v1/models, GET /health, GET /metrics,
GET /openapi.json. A request reaches the engine only after the guards (API key, content type,
body size and depth), strict schema validation, the model name, the unsupported-parameter
check and the context check; every refusal is an OpenAI-style error body (errors.py). Fields
the schema does not know are ignored and named in the `x-eyas-ignored-fields` header. The engine runs on its own thread; its
outputs come back to the event loop through one relay per loop (relay.py: one wake-up per
engine step), and a stream that falls behind sends the outputs it has not sent yet as one
event (choices.py, `next(merge=True)`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from eyas import __version__
from eyas.engine.grammar import GrammarError
from eyas.errors import EyasError
from eyas.models.tokenizer import raw_prompt_ids
from eyas.scheduler.engine import Engine, QueueFull, RequestRejected
from eyas.scheduler.request import RequestOutput
from eyas.server import protocol, structured, tools
from eyas.server.choices import ChoiceSet
from eyas.server.errors import APIError, install_handlers
from eyas.server.format import ChoiceView
from eyas.server.guards import check_api_key, read_json_body
from eyas.server.metrics import ServerMetrics
from eyas.server.openapi import openapi_document

log = logging.getLogger("eyas.server")
IGNORED_HEADER = "x-eyas-ignored-fields"


@dataclass
class ServerSettings:
    model_name: str  # the id clients send as "model" (and /v1/models lists)
    api_key: str | None = None  # when set, /v1 routes need "Authorization: Bearer KEY"
    max_body_bytes: int = 1 << 20  # larger bodies get 413
    retry_after_s: int = 1  # Retry-After on 503 (queue full)
    max_n: int = 16  # most samples per request (n)
    max_prompts: int = 64  # most prompts in one /v1/completions request

    def __post_init__(self) -> None:
        if not self.model_name:
            raise EyasError("model_name must be non-empty")
        if self.max_body_bytes < 1024:
            raise EyasError("max_body_bytes must be >= 1024")
        if self.api_key is not None and not self.api_key:
            raise EyasError("api_key must be non-empty when given")
        if self.max_n < 1 or self.max_prompts < 1:
            raise EyasError("max_n and max_prompts must be >= 1")


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def engine_failure(output: RequestOutput) -> APIError:
    """A request that failed inside the engine (its stage and error; no other request is
    affected): a 500, or the error event of its stream."""
    return APIError(500, f"generation failed inside the engine at {output.error or 'unknown'}",
                    code="internal_error")


def ignored_header(fields: list[str], most: int = 16) -> dict[str, str]:
    """The x-eyas-ignored-fields header (comma-separated paths, printable ASCII only)."""
    if not fields:
        return {}
    shown = ["".join(c if 32 < ord(c) < 127 and c != "," else "?" for c in f)[:64] for f in fields[:most]]
    if len(fields) > most:
        shown.append(f"...{len(fields) - most} more")
    return {IGNORED_HEADER: ",".join(shown)}


def create_app(engine: Engine, settings: ServerSettings, metrics: ServerMetrics,
               start_engine: bool = True) -> FastAPI:
    """start_engine: start the engine's loop on its own thread at start-up (False when the
    caller runs `engine.run()` itself, as `eyas serve` does on the main thread). Either way,
    the app's shutdown drains the engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if start_engine and not engine.alive:
            engine.start()
        yield
        await anyio.to_thread.run_sync(engine.shutdown)  # in-flight requests finish first

    app = FastAPI(title="eyas", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.openapi = lambda: openapi_document(app, __version__)
    install_handlers(app)
    created = int(time.time())
    tokenizer = engine.target.tokenizer

    @app.get("/health")
    async def health() -> dict[str, str]:
        if not engine.alive:
            raise APIError(503, "the engine is not running", code="engine_down")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_api_key(request, settings.api_key)
        return {"object": "list",
                "data": [protocol.model_card(settings.model_name, created, engine.max_model_len)]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed = await parse(request, protocol.ChatCompletionRequest)
        plan = tools.tool_plan(parsed)
        messages = tools.template_messages(parsed)
        try:
            prompt_ids = await anyio.to_thread.run_sync(tools.render, tokenizer, messages, plan)
        except Exception as error:  # no chat template, or one that rejects these roles
            raise APIError(400, f"the chat template cannot render these messages: {error}",
                           param="messages", code="invalid_value") from error
        limit_field = "max_completion_tokens" if parsed.max_completion_tokens else "max_tokens"
        grammar = await constraint(parsed, plan)
        return await respond(request, parsed, [prompt_ids], "messages", limit_field, chat=True,
                             grammar=grammar, plan=plan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = await parse(request, protocol.CompletionRequest)
        prompts = []
        vocab = engine.target.config.vocab_size
        for index, prompt in enumerate(parsed.prompts()):
            if isinstance(prompt, str):
                prompts.append(await anyio.to_thread.run_sync(raw_prompt_ids, tokenizer, prompt))
                continue
            if any(not 0 <= token < vocab for token in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt",
                               code="invalid_value")
            prompts.append(list(prompt))
        grammar = await constraint(parsed, None)
        return await respond(request, parsed, prompts, "prompt", "max_tokens", chat=False,
                             grammar=grammar)

    async def constraint(parsed: Any, plan: tools.ToolPlan | None) -> Any:
        """The request's compiled grammar (one constraint per choice is made from it), or None:
        structured output (response_format, guided_*) or a required / named tool call. 400
        for a bad schema."""
        asked = structured.grammar_request(parsed)
        from_tools = plan.grammar() if plan is not None else None
        if asked is not None and from_tools is not None:
            raise APIError(400, "response_format cannot be combined with tool_choice "
                                "'required' or a named function", param="response_format",
                           code="invalid_value")
        spec, param = asked if asked is not None else (from_tools, "tools")
        if spec is None:
            return None
        try:
            return await anyio.to_thread.run_sync(structured.compile_for, spec, engine.target)
        except GrammarError as error:
            raise APIError(400, f"invalid schema for structured output: {error}", param=param,
                           code="invalid_value") from error

    async def parse(request: Request, schema: type[protocol.SamplingRequest]) -> Any:
        check_api_key(request, settings.api_key)
        body = await read_json_body(request, settings.max_body_bytes)
        parsed = schema.model_validate(body)
        ignored = protocol.ignored_fields(body, schema)
        if ignored:
            log.warning("%s: ignored fields the server does not know: %s", request.url.path,
                        ", ".join(ignored))
        request.state.ignored_fields = ignored
        if parsed.model != settings.model_name:
            raise APIError(400, f"the model '{parsed.model}' does not exist here; this server "
                                f"serves '{settings.model_name}'", param="model", code="model_not_found")
        unsupported = protocol.unsupported_parameter(parsed)
        if unsupported is not None:
            field, message = unsupported
            raise APIError(400, message, param=field, code="unsupported_parameter")
        invalid = protocol.invalid_parameter(parsed, engine.target.config.vocab_size,
                                             settings.max_n, settings.max_prompts)
        if invalid is not None:
            field, message = invalid
            raise APIError(400, message, param=field, code="invalid_value")
        return parsed

    def processors_for(parsed: Any, prompt_ids: list[int], params: Any, grammar: Any = None) -> list:
        """Logits processors beyond those the sampling parameters ask for (the engine adds
        logit_bias and the penalties itself): a grammar's constraint, one per choice."""
        return [grammar.constraint()] if grammar is not None else []

    async def respond(http_request: Request, parsed: Any, prompts: list[list[int]],
                      prompt_field: str, limit_field: str, chat: bool, grammar: Any = None,
                      plan: tools.ToolPlan | None = None) -> Response:
        # 1. The context check and the queue, then the engine: n samples of every prompt.
        if not engine.alive:
            raise APIError(503, "the engine is not running", code="engine_down")

        def params_for(prompt_ids: list[int]) -> Any:
            max_tokens = parsed.requested_max_tokens
            if max_tokens is None:
                max_tokens = max(engine.max_model_len - len(prompt_ids), 1)
            return parsed.sampling_params(max_tokens)

        choices = ChoiceSet(engine, asyncio.get_running_loop())
        try:
            choices.submit(prompts, parsed.samples, params_for,
                           lambda prompt_ids, params: processors_for(parsed, prompt_ids, params, grammar))
        except RequestRejected as error:
            field = prompt_field if error.field == "prompt" else limit_field
            raise APIError(400, str(error), param=field, code=error.code) from error
        except QueueFull as error:
            metrics.request_rejected(error.reason)
            raise APIError(503, f"{error}; retry later", code="queue_full",
                           headers={"Retry-After": str(settings.retry_after_s)}) from error
        # 2. Stream the outputs, or collect them into one body.
        response_id = protocol.new_id("chatcmpl" if chat else "cmpl")
        headers = ignored_header(http_request.state.ignored_fields)
        view = ChoiceView(parsed, tokenizer, chat)
        if parsed.stream:
            return StreamingResponse(stream(choices, view, response_id, parsed.include_usage, plan),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": response_id,
                                              **headers})
        await collect(http_request, choices)
        build = protocol.chat_response if chat else protocol.completion_response
        body = build(response_id, settings.model_name, [view.whole(c) for c in choices.choices],
                     choices.usage(), choices.speculative())
        if plan is not None:  # tool calls parsed out of each choice's text (tools.py)
            for entry in body["choices"]:
                content, calls = plan.parse(entry["message"]["content"] or "")
                entry["message"] = {"role": "assistant", "content": content,
                                    **({"tool_calls": calls} if calls else {})}
                entry["finish_reason"] = plan.finish_reason(entry["finish_reason"], calls)
        return JSONResponse(body, headers=headers)

    async def collect(http_request: Request, choices: ChoiceSet) -> None:
        watcher = asyncio.create_task(abort_on_disconnect(http_request, choices))
        try:
            while not choices.finished:
                choice, output = await choices.next()
                if output.finish_reason == "error":
                    raise engine_failure(output)
        finally:
            watcher.cancel()
            choices.abort_unfinished()

    async def abort_on_disconnect(http_request: Request, choices: ChoiceSet) -> None:
        while True:
            message = await http_request.receive()
            if message["type"] == "http.disconnect":
                choices.abort_unfinished()
                return

    async def stream(choices: ChoiceSet, view: ChoiceView, response_id: str,
                     include_usage: bool, plan: tools.ToolPlan | None = None) -> AsyncIterator[str]:
        created, model = int(time.time()), settings.model_name
        usage_object = "chat.completion.chunk" if view.chat else "text_completion"
        tool_streams: dict[int, tools.ToolStream] = {}
        try:
            if view.chat:  # each choice opens with the assistant's role
                for choice in choices.choices:
                    yield sse(protocol.chat_chunk(response_id, model, created,
                                                  {"role": "assistant", "content": ""},
                                                  include_usage=include_usage, index=choice.index))
            while not choices.finished:  # outputs the client has not read yet go out as one
                choice, output = await choices.next(merge=True)
                if output.finish_reason == "error":  # this request alone failed
                    yield sse(engine_failure(output).body())
                    yield sse("[DONE]")
                    return
                if plan is not None:  # tool calls: deltas in OpenAI's shape (tools.py)
                    tool_stream = tool_streams.setdefault(choice.index, tools.ToolStream(plan))
                    deltas = tool_stream.feed(output.text) + (tool_stream.flush() if output.finished else [])
                    for delta in deltas:
                        yield sse(protocol.chat_chunk(response_id, model, created, delta, None,
                                                      include_usage, choice.index))
                    if output.finished:
                        reason = plan.finish_reason(output.finish_reason, tool_stream.calls)
                        chunk = protocol.chat_chunk(response_id, model, created, {}, reason,
                                                    include_usage, choice.index)
                        if len(choices.choices) == 1:
                            chunk = protocol.with_speculative(chunk, output.speculative)
                        yield sse(chunk)
                    continue
                line = view.text_event(choice, output, response_id, model, created, include_usage)
                if line is not None:  # the common case: a text delta, its JSON framing made once
                    yield line
                    continue
                chunk = view.chunk(choice, output, response_id, model, created, include_usage)
                if chunk is not None:
                    if output.finished and len(choices.choices) == 1:
                        chunk = protocol.with_speculative(chunk, output.speculative)
                    yield sse(chunk)
            if include_usage:
                yield sse(protocol.usage_chunk(response_id, model, created, usage_object,
                                               choices.usage(), choices.speculative()))
            yield sse("[DONE]")
        finally:
            choices.abort_unfinished()  # the client went away (the stream was cancelled)

    return app
