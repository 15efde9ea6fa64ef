"""A client for OpenAI-compatible chat endpoints (vLLM, SGLang, eyas serve, ...), with retries.

Usage:
    client = EndpointClient(EndpointConfig(urls=["http://10.0.0.5:8000"]), sampling)
    async with client:
        answer = await client.chat(messages)   # Answer(text, completion_tokens, finish_reason)

Several URLs are used round-robin (a fleet of servers). A failed request (connection error,
timeout, HTTP 429 or 5xx) is retried with exponential backoff; `max_consecutive_failures`
failed attempts in a row, across all requests, raise `EndpointDown` so the run stops cleanly. An
HTTP 4xx other than 429 is the request's own fault (e.g. a prompt longer than the context):
it raises `RequestFailed` at once (as does a request whose retries all fail), and only that
record is skipped.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from eyas.errors import EyasError


class EndpointDown(EyasError):
    """The endpoint failed too many times in a row."""


class RequestFailed(Exception):
    """This one request failed (HTTP 4xx, or every retry failed): skip the record, go on."""


@dataclass
class EndpointConfig:
    urls: list[str]
    model: str | None = None  # None: the first model that GET /v1/models lists
    concurrency: int = 8  # requests in flight, over all URLs
    retries: int = 3  # retries per request after the first attempt
    timeout: float = 300.0  # seconds per request
    backoff: float = 1.0  # first retry waits this long, then doubles (with jitter)
    max_consecutive_failures: int = 8
    api_key: str | None = field(default_factory=lambda: os.environ.get("OPENAI_API_KEY"))

    def __post_init__(self) -> None:
        if not self.urls:
            raise EyasError("give at least one --endpoint URL")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise EyasError(f"endpoint '{url}' must start with http:// or https://")
        for name, low in (("concurrency", 1), ("retries", 0), ("max_consecutive_failures", 1)):
            if getattr(self, name) < low:
                raise EyasError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if self.timeout <= 0 or self.backoff < 0:
            raise EyasError("--timeout must be > 0 and --backoff >= 0")


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise EyasError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise EyasError(f"--temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EyasError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EyasError(f"--top-k must be >= 0, got {self.top_k}")


@dataclass(frozen=True)
class Answer:
    text: str
    completion_tokens: int
    finish_reason: str  # "stop" or "length"


def api_base(url: str) -> str:
    """`http://host:8000`, `.../v1` or `.../v1/chat/completions` -> `http://host:8000/v1`."""
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url if url.endswith("/v1") else url + "/v1"


class EndpointClient:
    def __init__(self, config: EndpointConfig, sampling: SamplingConfig) -> None:
        self.config = config
        self.sampling = sampling
        self.bases = [api_base(url) for url in config.urls]
        self._next_base = itertools.cycle(self.bases)
        self._client: httpx.AsyncClient | None = None
        self.consecutive_failures = 0
        self.last_error = ""
        self.model = config.model

    async def __aenter__(self) -> EndpointClient:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        self._client = httpx.AsyncClient(timeout=self.config.timeout, headers=headers)
        if self.model is None:
            self.model = await self._discover_model()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self._client is not None
        await self._client.aclose()

    async def _discover_model(self) -> str:
        response = await self._request("GET", self.bases[0] + "/models", None)
        models = response.get("data") or []
        if not models:
            raise EyasError(f"{self.bases[0]}/models lists no model; pass --served-model NAME")
        return str(models[0]["id"])

    def body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.sampling.max_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
        }
        if self.sampling.top_k:
            body["top_k"] = self.sampling.top_k  # an extension that vLLM and SGLang accept
        if self.sampling.seed is not None:
            body["seed"] = self.sampling.seed
        return body

    async def chat(self, messages: list[dict[str, str]]) -> Answer:
        response = await self._request("POST", next(self._next_base) + "/chat/completions", self.body(messages))
        try:
            choice = response["choices"][0]
            text = choice["message"]["content"] or ""
            finish_reason = "length" if choice.get("finish_reason") == "length" else "stop"
            tokens = int((response.get("usage") or {}).get("completion_tokens") or 0)
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise RequestFailed(f"malformed response: {error!r}") from error
        return Answer(text, tokens, finish_reason)

    async def _request(self, method: str, url: str, body: dict[str, Any] | None) -> dict[str, Any]:
        assert self._client is not None, "use `async with EndpointClient(...)`"
        for attempt in range(self.config.retries + 1):
            try:
                response = await self._client.request(method, url, json=body)
                if response.status_code == 429 or response.status_code >= 500:
                    raise httpx.HTTPStatusError(f"HTTP {response.status_code}", request=response.request, response=response)
                if response.status_code >= 400:
                    raise RequestFailed(f"HTTP {response.status_code}: {response.text[:200]}")
                self.consecutive_failures = 0
                return response.json()
            except (httpx.TransportError, httpx.HTTPStatusError, ValueError) as error:
                self.consecutive_failures += 1
                self.last_error = f"{type(error).__name__}: {error}"[:300]
                if self.consecutive_failures >= self.config.max_consecutive_failures:
                    raise EndpointDown(
                        f"the endpoint failed {self.consecutive_failures} times in a row "
                        f"(last: {url}: {self.last_error})"
                    ) from error
                if attempt == self.config.retries:
                    raise RequestFailed(f"gave up after {attempt + 1} attempts: {self.last_error}") from error
                delay = self.config.backoff * 2**attempt
                await asyncio.sleep(delay * (0.5 + random.random()))
        raise AssertionError("unreachable")
