"""OpenAI-compatible request schemas (pydantic, strict types) and response builders.

Requests are validated strictly: a number sent as a string, a fractional number where an
integer is due, or a value out of range is a 400 naming the field (errors.py); an integral
float (`"n": 1.0`, `"max_tokens": 16.0`, as some JSON clients write every number) counts as the
integer. Unknown fields are ignored, as vLLM does, and reported: `ignored_fields` lists them
for the `x-eyas-ignored-fields` response header and a log line. Known OpenAI parameters that
eyas does not implement are refused by `unsupported_parameter` rather than silently ignored.

Extensions beside the OpenAI fields: `top_k`, `ignore_eos` in requests (as vLLM accepts them);
`speculative_decoding` in responses (per-request acceptance statistics, when the server
drafts).
"""

from __future__ import annotations

import time
import typing
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from eyas.engine.sampling import MAX_SEED, SamplingParams
from eyas.scheduler.request import RequestOutput


def integral(value: Any) -> Any:
    """1.0 -> 1 (JSON has one number type); anything else is left to the strict int check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(integral)]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made (tools.py)
    tool_call_id: str | None = None  # tool: the call this is the result of
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingRequest(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: Integer | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Integer | None = Field(None, ge=-1)  # extension; -1 or 0 = off
    n: Integer | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: Integer | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension
    # Structured outputs (eyas/server/structured.py): OpenAI's response_format, vLLM's guided_*.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # extension
    guided_regex: str | None = None  # extension
    guided_choice: list[str] | None = None  # extension

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0), seed=self.seed, stop=stop, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: Integer | None = None
    tools: list[Any] | None = None  # checked by eyas/server/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: Integer | None = None
    logprobs: Integer | None = None

    @property
    def requested_max_tokens(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for completions


def unsupported_parameter(request: SamplingRequest) -> tuple[str, str] | None:
    """(field, message) for the first parameter that eyas does not implement, if any."""
    checks: list[tuple[str, bool, str]] = [
        ("n", (request.n or 1) != 1, "n > 1 is not supported; send n separate requests"),
        ("presence_penalty", bool(request.presence_penalty), "presence_penalty is not supported"),
        ("frequency_penalty", bool(request.frequency_penalty), "frequency_penalty is not supported"),
        ("logit_bias", bool(request.logit_bias), "logit_bias is not supported"),
        ("stop", isinstance(request.stop, list) and len(request.stop) > 4,
         "at most 4 stop sequences are accepted"),
        ("stop", (request.stop == "") or (isinstance(request.stop, list) and "" in request.stop),
         "stop sequences must be non-empty strings"),
    ]
    if isinstance(request, ChatCompletionRequest):
        checks += [
            ("logprobs", bool(request.logprobs), "logprobs are not supported"),
            ("top_logprobs", request.top_logprobs is not None, "top_logprobs are not supported"),
            ("functions", bool(request.functions), "functions are not supported; use tools"),
        ]
    if isinstance(request, CompletionRequest):
        prompts = request.prompt
        several = isinstance(prompts, list) and prompts and not isinstance(prompts[0], int)
        checks += [
            ("echo", bool(request.echo), "echo is not supported"),
            ("suffix", bool(request.suffix), "suffix is not supported"),
            ("best_of", (request.best_of or 1) != 1, "best_of > 1 is not supported"),
            ("logprobs", bool(request.logprobs), "logprobs are not supported"),
            ("prompt", bool(several) and len(prompts) != 1,
             "one prompt per request is supported; send a list of prompts as separate requests"),
        ]
    return next(((field, message) for field, bad, message in checks if bad), None)


def ignored_fields(body: Any, schema: type[BaseModel], prefix: str = "") -> list[str]:
    """The fields of a request body that `schema` does not know (pydantic ignores them), as
    OpenAI-style paths: 'foo', 'messages.[0].name'."""
    if not isinstance(body, dict):
        return []
    found: list[str] = []
    for key, value in body.items():
        path = f"{prefix}{key}"
        field = schema.model_fields.get(key)
        if field is None:
            found.append(path)
            continue
        nested = nested_schema(field.annotation)
        if nested is None:
            continue
        if isinstance(value, list):
            for index, item in enumerate(value):
                found += ignored_fields(item, nested, f"{path}.[{index}].")
        else:
            found += ignored_fields(value, nested, f"{path}.")
    return found


def nested_schema(annotation: Any) -> type[BaseModel] | None:
    """The model inside a field's type (ChatMessage in list[ChatMessage], StreamOptions in
    StreamOptions | None), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = nested_schema(argument)
        if found is not None:
            return found
    return None


# ---- responses ----------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(final: RequestOutput) -> dict[str, int]:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens}


def chat_response(response_id: str, model: str, text: str, final: RequestOutput) -> dict[str, Any]:
    body = {
        "id": response_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": final.finish_reason}],
        "usage": usage(final),
    }
    return with_speculative(body, final)


def completion_response(response_id: str, model: str, text: str, final: RequestOutput) -> dict[str, Any]:
    body = {
        "id": response_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": final.finish_reason}],
        "usage": usage(final),
    }
    return with_speculative(body, final)


def chat_chunk(response_id: str, model: str, created: int, delta: dict[str, Any],
               finish_reason: str | None = None, include_usage: bool = False) -> dict[str, Any]:
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None  # OpenAI: null on every chunk but the last, when usage is asked for
    return chunk


def completion_chunk(response_id: str, model: str, created: int, text: str,
                     finish_reason: str | None = None, include_usage: bool = False) -> dict[str, Any]:
    chunk = {"id": response_id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(response_id: str, model: str, created: int, obj: str, final: RequestOutput) -> dict[str, Any]:
    chunk = {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
             "usage": usage(final)}
    return with_speculative(chunk, final)


def with_speculative(body: dict[str, Any], final: RequestOutput) -> dict[str, Any]:
    if final.speculative is not None:
        body["speculative_decoding"] = final.speculative
    return body


def model_card(name: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "eyas",
            "max_model_len": max_model_len}
