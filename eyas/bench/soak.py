"""`eyas bench soak`: a long mixed load against `eyas serve`, one server per drafting method.

Usage:
    eyas bench soak --model smollm2-135m --minutes 30 --concurrency 32
    eyas bench soak --model smollm2-135m --minutes 2 --drafts none --output runs/soak/none.json
    from eyas.bench.soak import SoakConfig, run_soak
    report = run_soak(SoakConfig(model="smollm2-135m", minutes=2, drafts=["none"]))

For each drafting method in turn (`--minutes` split evenly between them; server start-up not
counted):
1. start `python -m eyas serve --model M --draft D` as a child process (compare.ManagedServer);
2. `--concurrency` clients send chat requests back to back: prompts drawn from MT-Bench and
   ShareGPT first turns, max_tokens drawn from [16, 256], half of them streamed, a tenth of the
   streams closed by the client after a few chunks (cancelled), greedy and sampled mixed;
3. every `--sample-seconds` the server's resident memory (VmRSS from /proc/PID/status) is
   read; when the time is up the clients finish what they sent, the server must come back to
   idle (no KV row in use on /metrics), and it is stopped with SIGTERM.
Each request ends as exactly one of: finished (a whole answer: finish_reason stop or length,
a stream with its final chunk and [DONE]), cancelled (by the client, on purpose), timed_out
(no byte for `--request-timeout` seconds: the client gave up on an overloaded server),
http_4xx, http_5xx, or lost (anything else: a transport error, a stream cut before [DONE], an
answer that ended 'abort' or 'error' unasked). The targets: 0 lost, 0 5xx, 0 KV rows in use at
the end, resident memory after warm-up (minute 5, or 40% of a shorter slot) within 5% of the
end; the KV pool's own growth (on demand, kept) is reported beside it, and RSS less the KV pool
is what shows a leak. The JSON report is written atomically; progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eyas.bench.compare import ManagedServer, free_port, server_argv
from eyas.errors import EyasError
from eyas.utils.io import write_json_atomic

def default_drafts(model: str) -> list[str]:
    """Every drafting method that needs nothing but the model: none, ngram, the shipped EAGLE-3
    head where there is one for `model`, the target drafting for itself, layer-skip."""
    from eyas.eagle3.shipped import shipped_head_dir

    head = [f"eagle3:{model}"] if shipped_head_dir(model) is not None else []
    return ["none", "ngram", *head, "self", "layerskip:auto"]

OUTCOMES = ("finished", "cancelled", "timed_out", "http_4xx", "http_5xx", "lost")
SERVER_COMMAND = "{python} -m eyas serve --model {model} --draft {draft} --host {host} --port {port}"


@dataclass
class SoakConfig:
    model: str = "smollm2-135m"
    minutes: float = 30.0  # in all, split evenly between the drafting methods
    concurrency: int = 32  # clients, each with one request in flight
    drafts: list[str] = field(default_factory=lambda: default_drafts("smollm2-135m"))
    dataset: str = "mtbench+sharegpt"  # '+'-joined: mtbench, sharegpt, jsonl:PATH
    min_tokens: int = 16
    max_tokens: int = 256
    stream_share: float = 0.5  # of requests
    cancel_share: float = 0.1  # of streams, closed by the client mid-way
    sample_seconds: float = 10.0  # resident memory sampling period
    warmup_seconds: float = 300.0  # the memory baseline (capped at 40% of a method's slot)
    server_flags: str = ""  # more `eyas serve` flags, e.g. "--max-running 16 --dtype int4"
    request_timeout: float = 600.0
    start_timeout: float = 900.0
    seed: int = 0
    output: str = "runs/soak/report.json"

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.concurrency < 1 or self.sample_seconds <= 0:
            raise EyasError("--minutes, --concurrency and --sample-seconds must be positive")
        if not self.drafts:
            raise EyasError("give at least one drafting method (--drafts none,ngram,...)")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise EyasError(f"need 1 <= min tokens <= max tokens, got {self.min_tokens}..{self.max_tokens}")
        if not (0 <= self.stream_share <= 1 and 0 <= self.cancel_share <= 1):
            raise EyasError("--stream-share and --cancel-share are fractions in [0, 1]")

    @property
    def slot_seconds(self) -> float:
        return self.minutes * 60 / len(self.drafts)


def load_prompts(spec: str) -> list[tuple[dict[str, str], ...]]:
    """Chat messages of each prompt of the '+'-joined sets."""
    from eyas.bench.datasets import jsonl_prompts, mtbench_prompts, sharegpt_prompts

    prompts = []
    for name in spec.split("+"):
        if name == "mtbench":
            prompts += mtbench_prompts(80)
        elif name == "sharegpt":
            prompts += sharegpt_prompts(200)
        elif name.startswith("jsonl:"):
            prompts += jsonl_prompts(name[len("jsonl:"):], 100_000)
        else:
            raise EyasError(f"unknown soak dataset '{name}'; accepted: mtbench, sharegpt, jsonl:PATH")
    if not prompts:
        raise EyasError(f"the dataset '{spec}' holds no prompt")
    return [prompt.messages for prompt in prompts]


def resident_mib(pid: int) -> float | None:
    """VmRSS of a process in MiB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def metric(text: str, name: str) -> float | None:
    """The value of a label-free-ish series (first sample of `name`) in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    sent: int = 0
    completion_tokens: int = 0
    lost_examples: list[str] = field(default_factory=list)

    def add(self, outcome: str, detail: str = "") -> None:
        self.counts[outcome] += 1
        if outcome in ("lost", "http_5xx", "timed_out") and len(self.lost_examples) < 10:
            self.lost_examples.append(detail[:300])


class Client:
    """One request at a time against `url`, drawn from `prompts` with its own random stream."""

    def __init__(self, http: httpx.AsyncClient, model: str, prompts: list, config: SoakConfig,
                 rng: random.Random, tally: Tally) -> None:
        self.http, self.model, self.prompts, self.config, self.rng = http, model, prompts, config, rng
        self.tally = tally

    async def run(self, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            await self.one()

    async def one(self) -> None:
        rng, config = self.rng, self.config
        max_tokens = rng.randint(config.min_tokens, config.max_tokens)
        body: dict[str, Any] = {"model": self.model, "messages": list(rng.choice(self.prompts)),
                                "max_tokens": max_tokens}
        if rng.random() < 0.5:
            body.update(temperature=0.0)
        else:
            body.update(temperature=0.8, seed=rng.randrange(2**31))
        stream = rng.random() < config.stream_share
        cancel_after = rng.randint(1, max(1, max_tokens // 2)) if stream and rng.random() < config.cancel_share else None
        self.tally.sent += 1
        try:
            if stream:
                outcome, detail = await self.streamed(body, cancel_after)
            else:
                outcome, detail = await self.whole(body)
        except httpx.TimeoutException as error:  # the client gave up: an overloaded server
            outcome, detail = "timed_out", f"{type(error).__name__} after {config.request_timeout:g} s"
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as error:
            outcome, detail = "lost", f"{type(error).__name__}: {error}"
        self.tally.add(outcome, detail)

    async def whole(self, body: dict[str, Any]) -> tuple[str, str]:
        response = await self.http.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            return status_outcome(response.status_code), response.text
        answer = response.json()
        reason = answer["choices"][0]["finish_reason"]
        if reason not in ("stop", "length"):
            return "lost", f"finish_reason {reason}"
        self.tally.completion_tokens += answer["usage"]["completion_tokens"]
        return "finished", ""

    async def streamed(self, body: dict[str, Any], cancel_after: int | None) -> tuple[str, str]:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        chunks, reason, done, usage = 0, None, False, None
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return status_outcome(response.status_code), (await response.aread()).decode(errors="replace")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return "http_5xx", data
                chunks += 1
                if event.get("choices") and event["choices"][0].get("finish_reason"):
                    reason = event["choices"][0]["finish_reason"]
                if event.get("usage"):
                    usage = event["usage"]
                if cancel_after is not None and chunks > cancel_after and reason is None:
                    return "cancelled", ""  # leaving the block closes the connection
        if not done or reason not in ("stop", "length"):
            return "lost", f"stream ended: [DONE] {'seen' if done else 'missing'}, finish_reason {reason}"
        self.tally.completion_tokens += (usage or {}).get("completion_tokens", 0)
        return "finished", ""


def status_outcome(status: int) -> str:
    return "http_5xx" if status >= 500 else "http_4xx" if status >= 400 else "lost"


class MemorySampler(threading.Thread):
    """Every `period` seconds: the resident memory of `pid` and the KV pool's allocated size
    from `url`/metrics, as [(seconds since start, RSS MiB, KV MiB)]. The KV pool grows on
    demand and is kept (a longer request than any before raises it), so RSS less KV is what
    shows a leak."""

    def __init__(self, pid: int, url: str, period: float) -> None:
        super().__init__(name="soak-rss", daemon=True)
        self.pid, self.url, self.period = pid, url, period
        self.samples: list[tuple[float, float, float | None]] = []
        self.started = time.monotonic()
        self.halt = threading.Event()

    def sample(self) -> None:
        rss = resident_mib(self.pid)
        try:
            kv_bytes = metric(httpx.get(self.url + "/metrics", timeout=10).text, "eyas:kv_cache_bytes")
        except httpx.HTTPError:
            kv_bytes = None
        if rss is not None:
            kv = round(kv_bytes / 2**20, 1) if kv_bytes is not None else None
            self.samples.append((round(time.monotonic() - self.started, 1), round(rss, 1), kv))

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(self.period)

    def at(self, seconds: float) -> tuple[float, float, float | None] | None:
        """The first sample at or after `seconds` (else the last one)."""
        later = [sample for sample in self.samples if sample[0] >= seconds]
        return later[0] if later else (self.samples[-1] if self.samples else None)


def growth(before: float | None, after: float | None) -> float | None:
    return round(100 * (after - before) / before, 2) if before and after is not None else None


def soak_one(config: SoakConfig, draft: str, prompts: list, run_dir: Path) -> dict[str, Any]:
    """One drafting method: its own server, `slot_seconds` of load; its section of the report."""
    port = free_port()
    argv = server_argv(SERVER_COMMAND, config.model, draft, port) + shlex.split(config.server_flags)
    label = draft.replace(":", "_").replace("/", "_")
    server = ManagedServer(argv, port, run_dir / f"{label}.server.log", config.start_timeout, 60.0)
    progress(f"{draft}: starting {shlex.join(argv)}")
    with server:
        assert server.process is not None
        pid = server.process.pid
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        sampler = MemorySampler(pid, server.url, config.sample_seconds)
        sampler.start()
        tally = Tally()
        started = time.monotonic()
        asyncio.run(load(server.url, model, prompts, config, tally, started, draft, sampler))
        load_seconds = time.monotonic() - started
        idle_rows, metrics_text = wait_idle(server.url)
        sampler.sample()  # the end, once idle
        sampler.halt.set()
        warmup = min(config.warmup_seconds, 0.4 * config.slot_seconds)
        _, rss_warm, kv_warm = sampler.at(warmup) or (0, None, None)
        _, rss_end, kv_end = sampler.samples[-1] if sampler.samples else (0, None, None)
    exit_code = server.process.returncode
    known = None not in (rss_warm, rss_end, kv_warm, kv_end)
    less_kv = (rss_warm - kv_warm, rss_end - kv_end) if known else (None, None)
    return {
        "draft": draft, "server_command": shlex.join(argv), "seconds": round(load_seconds, 1),
        "sent": tally.sent, **tally.counts, "completion_tokens": tally.completion_tokens,
        "tokens_per_s": round(tally.completion_tokens / load_seconds, 2) if load_seconds else None,
        "kv_rows_in_use_end": idle_rows, "kv_rows_in_use_idle": 0,
        "kv_cache_slots_end": metric(metrics_text, "eyas:kv_cache_slots"),
        "request_failures": metric_sum(metrics_text, "eyas:request_failures_total"),
        "rss_warmup_at_s": round(warmup, 1), "rss_mib_after_warmup": rss_warm, "rss_mib_end": rss_end,
        "rss_growth_pct": growth(rss_warm, rss_end), "kv_mib_after_warmup": kv_warm, "kv_mib_end": kv_end,
        "rss_less_kv_growth_pct": growth(*less_kv),
        "rss_samples": sampler.samples,  # (s, RSS MiB, KV pool MiB) "server_exit_code": exit_code,
        "lost_examples": tally.lost_examples,
    }


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def load(url: str, model: str, prompts: list, config: SoakConfig, tally: Tally, started: float,
               draft: str, sampler: MemorySampler) -> None:
    stop_at = started + config.slot_seconds
    limits = httpx.Limits(max_connections=config.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=config.request_timeout, limits=limits,
                                 trust_env=False) as http:
        clients = [Client(http, model, prompts, config, random.Random(config.seed * 1000 + i), tally)
                   for i in range(config.concurrency)]
        tasks = [asyncio.create_task(client.run(stop_at)) for client in clients]
        while not all(task.done() for task in tasks):
            await asyncio.wait(tasks, timeout=config.sample_seconds)
            rss = sampler.samples[-1][1] if sampler.samples else float("nan")
            progress(f"{draft}: {time.monotonic() - started:5.0f}/{config.slot_seconds:.0f} s  sent "
                     f"{tally.sent}  " + "  ".join(f"{k} {v}" for k, v in tally.counts.items())
                     + f"  rss {rss:.0f} MiB")
        for task in tasks:
            task.result()


def wait_idle(url: str, timeout: float = 60.0) -> tuple[float | None, str]:
    """KV rows in use once the server has settled (cancelled requests end at a next step)."""
    deadline = time.monotonic() + timeout
    text, rows = "", None
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=30).text
        rows = metric(text, "eyas:kv_rows_in_use")
        running = metric(text, "vllm:num_requests_running")
        if rows == 0 and not running:
            break
        time.sleep(0.5)
    return rows, text


def progress(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


def run_soak(config: SoakConfig) -> dict[str, Any]:
    """Every drafting method in turn; the report (also written to config.output)."""
    prompts = load_prompts(config.dataset)
    output = Path(config.output)
    report: dict[str, Any] = {"config": asdict(config), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "machine": machine(), "methods": []}
    for draft in config.drafts:
        try:
            section = soak_one(config, draft, prompts, output.parent)
        except EyasError as error:
            section = {"draft": draft, "error": str(error).splitlines()[0]}
            progress(f"{draft}: not run: {section['error']}")
        report["methods"].append(section)
        write_json_atomic(output, report)  # after each method: a partial report survives
    report["ok"] = all(passed(section) for section in report["methods"])
    write_json_atomic(output, report)
    return report


def passed(section: dict[str, Any]) -> bool:
    return ("error" not in section and section["lost"] == 0 and section["http_5xx"] == 0
            and section["kv_rows_in_use_end"] == 0)


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"


def format_table(report: dict[str, Any]) -> str:
    rows = ["| draft | s | sent | finished | cancelled | timed out | lost | 5xx | 4xx | tok/s | "
            "KV rows end | RSS MiB warm-up -> end | growth | KV pool MiB | growth less KV |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["methods"]:
        if "error" in s:
            rows.append(f"| {s['draft']} | not run: {s['error']} |")
            continue
        rows.append(f"| {s['draft']} | {s['seconds']:.0f} | {s['sent']} | {s['finished']} | {s['cancelled']} | "
                    f"{s['timed_out']} | {s['lost']} | {s['http_5xx']} | {s['http_4xx']} | {s['tokens_per_s']} | "
                    f"{s['kv_rows_in_use_end']:.0f} | {s['rss_mib_after_warmup']:.0f} (at "
                    f"{s['rss_warmup_at_s']:.0f} s) -> {s['rss_mib_end']:.0f} | {pct(s['rss_growth_pct'])} | "
                    f"{s['kv_mib_after_warmup']} -> {s['kv_mib_end']} | {pct(s['rss_less_kv_growth_pct'])} |")
    return "\n".join(rows)
