"""The multi-turn workload of `eyas bench serve --workload multiturn`: ShareGPT conversations
sent turn by turn with their history, as a chat client does.

Usage:
    eyas bench serve --url http://127.0.0.1:8000 --workload multiturn --num-prompts 16 \\
        --max-turns 4 --concurrency 4 --max-tokens 64

Each conversation is a session: turn k sends the system-free history (user turns 1..k and the
server's own answers to turns 1..k-1, as it streamed them) and waits for the answer before turn
k + 1 goes out. `concurrency` sessions run at once. A server with prefix caching reuses the
history's keys and values, so the time to first token of turns 2+ is what it measures; the
summary reports it apart from the first turns' (`mean_ttft_ms_first_turn`,
`mean_ttft_ms_later_turns`, ...) and, from `/metrics`, the prefix cache hit rate over the level
(vLLM's `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`, in tokens).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import httpx

from eyas.bench.datasets import BenchPrompt
from eyas.bench.latency import RequestMetrics, StreamRecord, _stats_ms

MAX_TURN_CHARS = 1000  # longer user turns are cut (the history must fit the context)


def sharegpt_sessions(limit: int, max_turns: int) -> list[list[str]]:
    """User turns (2..max_turns each) of the first `limit` ShareGPT conversations that have two."""
    from eyas.data.records import RecordError, conversation_from_dict
    from eyas.data.sources import RawRecord, read_raw_records, resolve_source

    sessions: list[list[str]] = []
    for item in read_raw_records(resolve_source("sharegpt")):
        if not isinstance(item, RawRecord):
            continue
        try:
            turns = conversation_from_dict(item.value, "sharegpt", f"sharegpt-{item.line}").user_turns
        except RecordError:
            continue
        turns = [turn.strip()[:MAX_TURN_CHARS] for turn in turns if turn and turn.strip()]
        if len(turns) >= 2:
            sessions.append(turns[:max_turns])
            if len(sessions) >= limit:
                break
    return sessions


async def run_sessions(client: httpx.AsyncClient, url: str, model: str,
                       sessions: list[list[str]], concurrency: int, payload_for: Callable,
                       send: Callable, on_done: Callable[[], None] | None = None
                       ) -> tuple[list[StreamRecord], list[int], float]:
    """Every session turn by turn, `concurrency` sessions at once. Returns the records, each
    one's turn (1-based) and the seconds from the first request to the last answer."""
    semaphore = asyncio.Semaphore(concurrency)
    records: list[StreamRecord] = []
    turns: list[int] = []

    async def one(session: list[str]) -> None:
        async with semaphore:
            history: list[dict[str, str]] = []
            for index, question in enumerate(session):
                history.append({"role": "user", "content": question})
                prompt = BenchPrompt(tuple(history), None)
                record = await send(client, url, payload_for(prompt), prompt)
                records.append(record)
                turns.append(index + 1)
                if on_done:
                    on_done()
                if record.error:
                    return  # the conversation cannot go on without its answer
                history.append({"role": "assistant", "content": "".join(record.chunk_texts)})

    started = asyncio.get_running_loop().time()
    await asyncio.gather(*(one(session) for session in sessions))
    return records, turns, asyncio.get_running_loop().time() - started


def turn_summary(metrics: list[RequestMetrics], turns: list[int]) -> dict[str, Any]:
    """TTFT statistics (ms) of first turns and of later turns, and how many of each."""
    first = [m.ttft for m, turn in zip(metrics, turns) if m.success and turn == 1]
    later = [m.ttft for m, turn in zip(metrics, turns) if m.success and turn > 1]
    summary: dict[str, Any] = {"first_turns": len(first), "later_turns": len(later)}
    for name, values in (("first_turn", first), ("later_turns", later)):
        stats = _stats_ms("ttft", values)
        summary.update({key.replace("_ms", f"_ms_{name}"): value for key, value in stats.items()})
    return summary


async def scrape_prefix_counters(client: httpx.AsyncClient, base_url: str) -> tuple[float, float] | None:
    """(queries, hits) of the prefix cache from `/metrics` (vLLM's names); None if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await client.get(f"{base_url}/metrics", timeout=10.0)
        families = list(text_string_to_metric_families(response.text))
    except (httpx.HTTPError, ValueError, TypeError, IndexError):
        return None
    totals = {"queries": 0.0, "hits": 0.0}
    found = False
    for sample in (s for family in families for s in family.samples):
        short = sample.name.removeprefix("vllm:prefix_cache_").removesuffix("_total")
        if sample.name.startswith("vllm:prefix_cache_") and short in totals:
            totals[short] += float(sample.value)
            found = True
    return (totals["queries"], totals["hits"]) if found else None


def hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> dict[str, Any]:
    if before is None or after is None or after[0] - before[0] <= 0:
        return {"prefix_cache_queries": None, "prefix_cache_hits": None, "prefix_cache_hit_rate": None}
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries}
