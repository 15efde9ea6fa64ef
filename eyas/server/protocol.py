"""OpenAI-compatible request schemas (pydantic, strict types) and response builders.

Requests are validated strictly: a number sent as a string, a fractional number where an
integer is due, or a value out of range is a 400 naming the field (errors.py); an integral
float (`"n": 1.0`, `"max_tokens": 16.0`, as some JSON clients write every number) counts as the
integer. Unknown fields are ignored, as vLLM does, and reported: `ignored_fields` lists them
for the `x-eyas-ignored-fields` response header and a log line. Known OpenAI parameters that
eyas does not implement are refused by `unsupported_parameter` rather than silently ignored.

Extensions beside the OpenAI fields: `top_k`, `ignore_eos`, `repetition_penalty` in requests
(as vLLM accepts them); `speculative_decoding` in responses (per-request acceptance
statistics, when the server drafts).
"""

from __future__ import annotations

import time
import typing
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from eyas.engine.sampling import MAX_LOGPROBS, MAX_SEED, SamplingParams


def integral(value: Any) -> Any:
    """1.0 -> 1 (JSON has one number type); anything else is left to the strict int check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(integral)]
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`


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
    repetition_penalty: float | None = Field(None, gt=0.0)  # extension (vLLM's)
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias in [-100, 100]
    user: str | None = None
    ignore_eos: bool = False  # extension
    # Structured outputs (eyas/server/structured.py): OpenAI's response_format, vLLM's guided_*.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # extension
    guided_regex: str | None = None  # extension
    guided_choice: list[str] | None = None  # extension

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters (after `invalid_parameter` found nothing wrong)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0), seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
            logprobs=self.output_logprobs, prompt_logprobs=self.prompt_logprobs)

    @property
    def output_logprobs(self) -> int | None:
        return None  # the routes' schemas say

    @property
    def prompt_logprobs(self) -> int | None:
        return None

    @property
    def samples(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: Integer | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None  # checked by eyas/server/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def output_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: Integer | None = Field(None, ge=1)
    logprobs: Integer | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @property
    def requested_max_tokens(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for completions

    @property
    def output_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string, or a list of token ids, each)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)  # [] is refused by invalid_parameter


def unsupported_parameter(request: SamplingRequest) -> tuple[str, str] | None:
    """(field, message) for the first parameter that eyas does not implement, if any."""
    checks: list[tuple[str, bool, str]] = [
        ("stop", isinstance(request.stop, list) and len(request.stop) > 4,
         "at most 4 stop sequences are accepted"),
        ("stop", (request.stop == "") or (isinstance(request.stop, list) and "" in request.stop),
         "stop sequences must be non-empty strings"),
    ]
    if isinstance(request, ChatCompletionRequest):
        checks += [
            ("functions", bool(request.functions), "functions are not supported; use tools"),
        ]
    if isinstance(request, CompletionRequest):
        checks += [
            ("suffix", bool(request.suffix), "suffix is not supported"),
            ("best_of", (request.best_of or request.samples) != request.samples,
             "best_of other than n is not supported (vLLM's V1 engine refuses it too); "
             "ask for n samples and rank them yourself"),
        ]
    return next(((field, message) for field, bad, message in checks if bad), None)


def invalid_parameter(request: SamplingRequest, vocab_size: int, max_n: int,
                      max_prompts: int) -> tuple[str, str] | None:
    """(field, message) for the first value out of what the server accepts, if any (the
    schema checked types and plain ranges already)."""
    checks: list[tuple[str, bool, str]] = [
        ("n", request.samples > max_n, f"n is {request.samples}; this server allows at most {max_n} "
                                      f"(--max-n)"),
    ]
    for token, bias in (request.logit_bias or {}).items():
        key = f"logit_bias.{token}"
        if not token.isdigit() or int(token) >= vocab_size:
            checks.append((key, True, f"logit_bias keys are token ids in [0, {vocab_size}) written "
                                      f"as strings; got {token!r}"))
        elif not -100.0 <= bias <= 100.0:
            checks.append((key, True, f"logit_bias values are in [-100, 100]; got {bias} for {token}"))
    if isinstance(request, ChatCompletionRequest):
        checks.append(("top_logprobs", request.top_logprobs is not None and not request.logprobs,
                       "top_logprobs needs logprobs: true"))
    if isinstance(request, CompletionRequest):
        prompts = request.prompts()
        checks += [
            ("prompt", not prompts, "prompt is an empty list"),
            ("prompt", len(prompts) > max_prompts,
             f"prompt holds {len(prompts)} prompts; this server takes at most {max_prompts} per "
             f"request (--max-prompts)"),
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


def chat_choice(index: int, text: str, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(response_id: str, model: str, choices: list[dict[str, Any]],
                  usage: dict[str, int], speculative: dict[str, Any] | None) -> dict[str, Any]:
    body = {"id": response_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage}
    return with_speculative(body, speculative)


def completion_response(response_id: str, model: str, choices: list[dict[str, Any]],
                        usage: dict[str, int], speculative: dict[str, Any] | None) -> dict[str, Any]:
    body = {"id": response_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage}
    return with_speculative(body, speculative)


def chat_chunk(response_id: str, model: str, created: int, delta: dict[str, Any],
               finish_reason: str | None = None, include_usage: bool = False, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None  # OpenAI: null on every chunk but the last, when usage is asked for
    return chunk


def completion_chunk(response_id: str, model: str, created: int, text: str,
                     finish_reason: str | None = None, include_usage: bool = False, index: int = 0,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk = {"id": response_id, "object": "text_completion", "created": created, "model": model,
             "choices": [completion_choice(index, text, finish_reason, logprobs)]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(response_id: str, model: str, created: int, obj: str, usage: dict[str, int],
                speculative: dict[str, Any] | None) -> dict[str, Any]:
    chunk = {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
             "usage": usage}
    return with_speculative(chunk, speculative)


def with_speculative(body: dict[str, Any], speculative: dict[str, Any] | None) -> dict[str, Any]:
    if speculative is not None:
        body["speculative_decoding"] = speculative
    return body


def model_card(name: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "eyas",
            "max_model_len": max_model_len}
