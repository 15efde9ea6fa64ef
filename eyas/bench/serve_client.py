"""The serving benchmark client: stream requests to an OpenAI-compatible server, level by level.

Usage:
    from eyas.bench.serve_client import ServeBenchConfig, SweepConfig, run_serve_benchmark
    run = run_serve_benchmark(ServeBenchConfig(url="http://127.0.0.1:8000", label="eagle3",
                                               sweep=SweepConfig(concurrency=[1, 4, 16])))
    run["results"][0]["median_tpot_ms"]

Per concurrency level: warm-up requests (timings discarded), a scrape of `/metrics`, then all
prompts sent at once through a semaphore of `concurrency` slots (vLLM's `--max-concurrency`
with an infinite request rate), then a second scrape. The client only records when chunks arrive
(`StreamRecord`); every token count and latency is computed after the sweep, so tokenizing never
delays a stream that is still running (definitions in `eyas.bench.latency`).

Works with eyas, vLLM and SGLang: `stream: true` with `stream_options.include_usage`, content
from `choices[0].delta.content` (chat) or `choices[0].text` (completions). The streamed
requests go through a small asyncio client by default (`sse_client.py`; `client="httpx"` for
httpx), so that the load generator takes little CPU from a server on the same cores; each
level records the client's own CPU seconds (`client_cpu_s`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx

from eyas.bench.datasets import BenchPrompt, check_dataset_spec
from eyas.bench.latency import StreamRecord
from eyas.bench.metrics_scrape import SpecDecodeCounters, scrape_spec_counters
from eyas.bench.sse_client import HTTPStatusError, post_events
from eyas.errors import EyasError

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MAX_PROMPTS = 100_000
MAX_CONCURRENCY = 4096
WARMUP_MAX_TOKENS = 16
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WORKLOADS = ("single", "multiturn")  # one request per prompt | conversations turn by turn
CLIENTS = ("raw", "httpx")  # the streamed requests' HTTP client (sse_client.py | httpx)


@dataclass
class SweepConfig:
    """What is sent at each level; the same for every server of a comparison."""

    dataset: str = "mtbench"  # mtbench, sharegpt, random or jsonl:PATH
    num_prompts: int = 32  # per concurrency level
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    max_tokens: int = 128
    endpoint: str = "chat"  # one of ENDPOINTS
    temperature: float = 0.0
    ignore_eos: bool = False  # vLLM/SGLang extension; sent only when true
    continuous_usage_stats: bool = False  # ask for usage in every chunk (vLLM extension)
    input_len: int = 128  # tokens per prompt of the random dataset
    seed: int = 0
    warmup: int = 1  # warm-up rounds per level, each `concurrency` short requests
    tokenizer: str = "smollm2-135m"  # for counts the server does not report; "none" = no tokenizer
    request_timeout: float = 600.0  # seconds per request
    level_timeout: float = 3600.0  # seconds per level; requests still running are cancelled
    workload: str = "single"  # multiturn: ShareGPT conversations turn by turn (multiturn.py)
    max_turns: int = 4  # multiturn: most user turns per conversation
    client: str = "raw"  # raw: eyas.bench.sse_client, little CPU per chunk; httpx: proxies, HTTP/2

    def __post_init__(self) -> None:
        check_dataset_spec(self.dataset)
        if self.client not in CLIENTS:
            raise EyasError(f"unknown client '{self.client}'; accepted: {', '.join(CLIENTS)}")
        if not 1 <= self.num_prompts <= MAX_PROMPTS:
            raise EyasError(f"--num-prompts must be in [1, {MAX_PROMPTS}], got {self.num_prompts}")
        if not self.concurrency or any(not 1 <= c <= MAX_CONCURRENCY for c in self.concurrency):
            raise EyasError(f"--concurrency needs levels in [1, {MAX_CONCURRENCY}], e.g. 1,2,4,8,16; "
                            f"got {self.concurrency}")
        if self.endpoint not in ENDPOINTS:
            raise EyasError(f"unknown endpoint '{self.endpoint}'; accepted: {', '.join(ENDPOINTS)}")
        if self.max_tokens < 1 or self.input_len < 1 or self.warmup < 0:
            raise EyasError("--max-tokens and --input-len must be >= 1, --warmup >= 0")
        if not 0.0 <= self.temperature <= 2.0:
            raise EyasError(f"--temperature must be in [0, 2], got {self.temperature}")
        if self.workload not in WORKLOADS:
            raise EyasError(f"unknown workload '{self.workload}'; accepted: {', '.join(WORKLOADS)}")
        if self.workload == "multiturn" and (self.endpoint != "chat" or self.max_turns < 2 or
                                             self.dataset not in ("mtbench", "sharegpt")):
            raise EyasError("--workload multiturn sends ShareGPT conversations (--dataset sharegpt) "
                            "to --endpoint chat with --max-turns >= 2")
        if self.request_timeout <= 0 or self.level_timeout <= 0:
            raise EyasError("--request-timeout and --level-timeout must be > 0 seconds")


@dataclass
class ServeBenchConfig:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)
    label: str = "default"  # the configuration's name in tables and plots
    model: str | None = None  # None: the first model of GET /v1/models
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EyasError(f"--url must look like http://HOST:PORT, got '{self.url}'")
        self.url = self.url.rstrip("/").removesuffix("/v1").rstrip("/")
        if not self.label.strip():
            raise EyasError("--label must not be empty")

    @property
    def is_loopback(self) -> bool:
        return urlsplit(self.url).hostname in LOOPBACK_HOSTS


@dataclass
class LevelRecords:
    """The raw outcome of one concurrency level, before any token counting."""

    concurrency: int
    records: list[StreamRecord]
    duration: float  # seconds from the first request sent to the last one finished
    counters_before: SpecDecodeCounters | None
    counters_after: SpecDecodeCounters | None
    turns: list[int] | None = None  # multiturn: each record's turn (1-based)
    prefix_before: tuple[float, float] | None = None  # prefix cache (queries, hits) scraped
    prefix_after: tuple[float, float] | None = None
    client_cpu_s: float | None = None  # CPU seconds of this process while the level's requests ran


def build_payload(prompt: BenchPrompt, model: str, sweep: SweepConfig,
                  max_tokens: int) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                               "temperature": sweep.temperature, "stream": True,
                               "stream_options": {"include_usage": True}}
    if sweep.endpoint == "chat":
        payload["messages"] = list(prompt.messages)
    else:
        payload["prompt"] = prompt.text
    if sweep.continuous_usage_stats:
        payload["stream_options"]["continuous_usage_stats"] = True
    if sweep.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text in one streamed chunk (chat delta or completion text)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        return reasoning + (delta.get("content") or "")
    return choice.get("text") or ""


def take_event(record: StreamRecord, arrived: float, data: str) -> bool:
    """Fold one SSE `data:` field into the record; True when the stream is over ([DONE] or an
    error event)."""
    if data == "[DONE]":
        return True
    chunk = json.loads(data)
    if chunk.get("error"):
        record.error = f"error in stream: {json.dumps(chunk['error'])[:300]}"
        return True
    usage = chunk.get("usage") or None
    text = chunk_text(chunk)
    if text:
        record.chunk_times.append(arrived)
        record.chunk_texts.append(text)
        record.chunk_usage_tokens.append(usage.get("completion_tokens") if usage else None)
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)
    return False


async def _read_stream(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                       record: StreamRecord) -> None:
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {body[:300]}"
            return
        async for line in response.aiter_lines():
            now = time.perf_counter()
            if line.startswith("data:") and take_event(record, now, line[len("data:"):].strip()):
                return


async def _read_stream_raw(url: str, payload: dict[str, Any], record: StreamRecord) -> None:
    try:
        events = await post_events(url, payload)  # JSON is parsed once the answer is complete
    except HTTPStatusError as error:
        record.error = str(error)
        return
    for arrived, data in events:
        if take_event(record, arrived, data):
            return


async def stream_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                         prompt: BenchPrompt, timeout: float, raw: bool = False) -> StreamRecord:
    """Send one streaming request and record when each content chunk arrived (raw: through
    eyas.bench.sse_client instead of `client`)."""
    record = StreamRecord(start=time.perf_counter(), input_tokens_hint=prompt.input_tokens,
                          prompt_text=prompt.counted_text())
    reading = _read_stream_raw(url, payload, record) if raw else _read_stream(client, url, payload, record)
    try:
        await asyncio.wait_for(reading, timeout)
    except asyncio.TimeoutError:
        record.error = f"timed out after {timeout:g} s (--request-timeout)"
    except Exception as error:  # one failed request must not stop the benchmark: it is recorded
        record.error = f"{type(error).__name__}: {error}"
    record.end = time.perf_counter()
    return record


async def send_all(client: httpx.AsyncClient, url: str, jobs: list[tuple[dict[str, Any], BenchPrompt]],
                   concurrency: int, sweep: SweepConfig,
                   on_done: Callable[[], None] | None = None) -> tuple[list[StreamRecord], float]:
    """Run `jobs` with at most `concurrency` in flight; returns records (in job order), seconds."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(payload: dict[str, Any], prompt: BenchPrompt) -> StreamRecord:
        async with semaphore:
            record = await stream_request(client, url, payload, prompt, sweep.request_timeout,
                                          raw=sweep.client == "raw")
        if on_done:
            on_done()
        return record

    started = time.perf_counter()
    tasks = [asyncio.create_task(one(payload, prompt)) for payload, prompt in jobs]
    done, pending = await asyncio.wait(tasks, timeout=sweep.level_timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - started
    records = [task.result() if task in done else
               StreamRecord(start=started, end=started + duration,
                            error=f"cancelled: the level ran past {sweep.level_timeout:g} s "
                                  f"(--level-timeout)")
               for task in tasks]
    return records, duration


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id that GET /v1/models lists."""
    try:
        response = await client.get(f"{base_url}/v1/models", timeout=30.0)
    except httpx.HTTPError as error:
        raise EyasError(f"cannot reach {base_url} ({type(error).__name__}: {error}); "
                        f"is the server running?") from error
    if response.status_code != 200:
        raise EyasError(f"GET {base_url}/v1/models answered HTTP {response.status_code}; "
                        f"pass --model NAME")
    models = (response.json() or {}).get("data") or []
    if not models or "id" not in models[0]:
        raise EyasError(f"GET {base_url}/v1/models listed no model; pass --model NAME")
    return str(models[0]["id"])


async def run_level(client: httpx.AsyncClient, config: ServeBenchConfig, model: str,
                    prompts: list[BenchPrompt], concurrency: int, progress: bool) -> LevelRecords:
    from tqdm import tqdm

    sweep = config.sweep
    url = config.url + ENDPOINTS[sweep.endpoint]
    # 1. Warm-up: `warmup` rounds of `concurrency` short requests; timings discarded.
    warm_max_tokens = min(WARMUP_MAX_TOKENS, sweep.max_tokens)
    warm = prompts
    if sweep.workload == "multiturn":  # not the conversations: their first turns would be cached
        from eyas.bench.datasets import mtbench_prompts

        warm = mtbench_prompts(max(1, concurrency))
    warm_jobs = [(build_payload(warm[i % len(warm)], model, sweep, warm_max_tokens),
                  warm[i % len(warm)]) for i in range(sweep.warmup * concurrency)]
    if warm_jobs:
        warm_records, _ = await send_all(client, url, warm_jobs, concurrency, sweep)
        errors = [r.error for r in warm_records if r.error]
        if len(errors) == len(warm_records):
            raise EyasError(f"every warm-up request to {url} failed; first error: {errors[0]}")
    # 2. Measured requests between two scrapes of /metrics.
    if sweep.workload == "multiturn":
        return await _run_sessions_level(client, config, model, prompts, concurrency, progress)
    before = await scrape_spec_counters(client, config.url)
    jobs = [(build_payload(prompt, model, sweep, sweep.max_tokens), prompt) for prompt in prompts]
    with tqdm(total=len(jobs), desc=f"{config.label} c={concurrency}", disable=not progress,
              leave=False) as bar:
        cpu = time.process_time()
        records, duration = await send_all(client, url, jobs, concurrency, sweep,
                                           on_done=lambda: bar.update(1))
        cpu = time.process_time() - cpu
    after = await scrape_spec_counters(client, config.url)
    return LevelRecords(concurrency, records, duration, before, after, client_cpu_s=cpu)


async def _run_sessions_level(client: httpx.AsyncClient, config: ServeBenchConfig, model: str,
                              prompts: list[BenchPrompt], concurrency: int,
                              progress: bool) -> LevelRecords:
    """The multi-turn workload (multiturn.py): `prompts` carry one conversation each."""
    from tqdm import tqdm

    from eyas.bench.multiturn import run_sessions, scrape_prefix_counters

    sweep = config.sweep
    url = config.url + ENDPOINTS[sweep.endpoint]
    sessions = [[m["content"] for m in prompt.messages] for prompt in prompts]
    before = await scrape_spec_counters(client, config.url)
    prefix_before = await scrape_prefix_counters(client, config.url)
    with tqdm(total=sum(map(len, sessions)), desc=f"{config.label} c={concurrency}",
              disable=not progress, leave=False) as bar:
        records, turns, duration = await run_sessions(
            client, url, model, sessions, concurrency,
            lambda prompt: build_payload(prompt, model, sweep, sweep.max_tokens),
            lambda c, u, payload, prompt: stream_request(c, u, payload, prompt, sweep.request_timeout,
                                                         raw=sweep.client == "raw"),
            on_done=lambda: bar.update(1))
    after = await scrape_spec_counters(client, config.url)
    prefix_after = await scrape_prefix_counters(client, config.url)
    return LevelRecords(concurrency, records, duration, before, after, turns, prefix_before,
                        prefix_after)


async def run_sweep(config: ServeBenchConfig, prompts: list[BenchPrompt],
                    progress: bool = True) -> tuple[str, list[LevelRecords]]:
    """Every concurrency level in turn; returns the model id used and the raw records."""
    limits = httpx.Limits(max_connections=max(config.sweep.concurrency) + 4,
                          max_keepalive_connections=max(config.sweep.concurrency) + 4)
    timeout = httpx.Timeout(config.sweep.request_timeout, connect=30.0)
    # trust_env=False on loopback: a proxy from the environment must not see local traffic.
    async with httpx.AsyncClient(limits=limits, timeout=timeout,
                                 trust_env=not config.is_loopback) as client:
        model = config.model or await discover_model(client, config.url)
        levels = [await run_level(client, config, model, prompts, concurrency, progress)
                  for concurrency in config.sweep.concurrency]
    return model, levels
