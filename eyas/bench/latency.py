"""Per-request latencies from the arrival times of stream chunks, and their summary per level.

Usage:
    metrics = request_metrics(record, count_tokens)        # one StreamRecord -> RequestMetrics
    summary = summarize_level(metrics_list, duration_s)    # vLLM-named fields, times in ms

Definitions (client clock, `time.perf_counter`, from just before the request is sent):

- TTFT: arrival of the first chunk that carries content (text, or reasoning text).
- E2EL: end of the stream (`data: [DONE]` or the connection closing).
- TPOT: (E2EL - TTFT) / (output_tokens - 1), for requests with at least 2 output tokens.
- ITL: the gaps between successive content chunks, attributed to tokens: a chunk that brings
  k >= 1 tokens after a gap g counts as k inter-token latencies of g / k each (SGLang's rule).
  vLLM's OpenAI client counts one gap per chunk, which inflates ITL by the acceptance length
  when a speculative server streams several tokens per chunk. The tokens of the first chunk
  arrive at TTFT and have no ITL.
- Tokens per chunk, first source that applies: the server's per-chunk usage (vLLM's
  `continuous_usage_stats`); one per chunk when the final usage says there are exactly as many
  tokens as chunks; else the growth of the tokenizer's count of the text received so far (at
  least 1 a chunk), rescaled so that the chunks add up to the server's `completion_tokens` when
  it sends one (the benchmark's tokenizer may not be the server's); else one per chunk.
- Output tokens: the usage chunk's `completion_tokens`, else the tokenizer's count of the whole
  text, else the number of content chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

TokenCounter = Callable[[str], int]  # text -> number of tokens
PERCENTILES = (90, 99)
LATENCY_NAMES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class StreamRecord:
    """What the client saw of one streamed request; timings are derived from it afterwards."""

    start: float  # perf_counter() just before the request was sent
    input_tokens_hint: int | None = None  # the prompt's token count when known before sending
    prompt_text: str = ""  # counted with the tokenizer when the server sends no usage
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    chunk_texts: list[str] = field(default_factory=list)
    chunk_usage_tokens: list[int | None] = field(default_factory=list)  # cumulative, per chunk
    end: float = 0.0
    prompt_tokens: int | None = None  # from the usage chunk
    completion_tokens: int | None = None  # from the usage chunk
    error: str | None = None


@dataclass
class RequestMetrics:
    success: bool
    input_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2el: float = 0.0  # seconds
    tpot: float | None = None  # seconds; None below 2 output tokens
    itl: list[float] = field(default_factory=list)  # seconds, one per token after the first chunk
    error: str | None = None


def chunk_token_counts(record: StreamRecord, count_tokens: TokenCounter | None) -> list[int]:
    """Tokens brought by each content chunk (see the module docstring for the sources)."""
    chunks = len(record.chunk_texts)
    usage = record.chunk_usage_tokens
    if chunks and len(usage) == chunks and all(u is not None for u in usage):
        counts, previous = [], 0
        for cumulative in usage:
            counts.append(max(1, int(cumulative) - previous))
            previous = max(previous, int(cumulative))
        return counts
    if record.completion_tokens == chunks or count_tokens is None:
        return [1] * chunks
    cumulative, text = [], ""
    for piece in record.chunk_texts:
        text += piece
        cumulative.append(max(count_tokens(text), cumulative[-1] if cumulative else 0))
    if record.completion_tokens and cumulative[-1] > 0:  # the server's total, spread in proportion
        scale = record.completion_tokens / cumulative[-1]
        cumulative = [round(total * scale) for total in cumulative]
    return [max(1, total - previous) for total, previous in zip(cumulative, [0, *cumulative])]


def needs_tokenizer(record: StreamRecord) -> bool:
    """Whether `request_metrics` would use a tokenizer for this record."""
    if record.error is not None or not record.chunk_texts:
        return False
    known_chunks = all(u is not None for u in record.chunk_usage_tokens)
    known_input = record.prompt_tokens is not None or record.input_tokens_hint is not None
    return not (known_input and record.completion_tokens is not None
                and (known_chunks or record.completion_tokens == len(record.chunk_texts)))


def request_metrics(record: StreamRecord, count_tokens: TokenCounter | None) -> RequestMetrics:
    if record.error is not None:
        return RequestMetrics(success=False, error=record.error)
    if not record.chunk_times:
        return RequestMetrics(success=False, error="the stream carried no content")
    # 1. Token counts: usage first, then the tokenizer, then one per chunk.
    counts = chunk_token_counts(record, count_tokens)
    if record.completion_tokens is not None:
        output_tokens = record.completion_tokens
    elif count_tokens is not None:
        output_tokens = count_tokens("".join(record.chunk_texts))
    else:
        output_tokens = sum(counts)
    if record.prompt_tokens is not None:
        input_tokens = record.prompt_tokens
    elif record.input_tokens_hint is not None:
        input_tokens = record.input_tokens_hint
    else:
        input_tokens = count_tokens(record.prompt_text) if count_tokens else 0
    # 2. Latencies.
    ttft = record.chunk_times[0] - record.start
    e2el = record.end - record.start
    itl: list[float] = []
    for index in range(1, len(record.chunk_times)):
        gap = record.chunk_times[index] - record.chunk_times[index - 1]
        itl.extend([gap / counts[index]] * counts[index])
    tpot = (e2el - ttft) / (output_tokens - 1) if output_tokens >= 2 else None
    return RequestMetrics(success=True, input_tokens=input_tokens, output_tokens=output_tokens,
                          ttft=ttft, e2el=e2el, tpot=tpot, itl=itl)


def _stats_ms(name: str, values_s: list[float]) -> dict[str, float | None]:
    """mean/median/std/p90/p99 of `values_s` (seconds) in ms, named like vLLM's output."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms",
            *(f"p{p}_{name}_ms" for p in PERCENTILES)]
    if not values_s:
        return dict.fromkeys(keys)
    values = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = [values.mean(), np.median(values), values.std(),
             *(np.percentile(values, p) for p in PERCENTILES)]
    return {key: float(value) for key, value in zip(keys, stats)}


def summarize_level(metrics: list[RequestMetrics], duration: float) -> dict[str, Any]:
    """Aggregate one concurrency level: counts, throughputs and latency statistics (ms)."""
    done = [m for m in metrics if m.success]
    total_input = sum(m.input_tokens for m in done)
    total_output = sum(m.output_tokens for m in done)
    per_second = 1.0 / duration if duration > 0 else 0.0
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(metrics) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) * per_second,
        "output_throughput": total_output * per_second,
        "total_token_throughput": (total_input + total_output) * per_second,
    }
    series = {
        "ttft": [m.ttft for m in done],
        "tpot": [m.tpot for m in done if m.tpot is not None],
        "itl": [gap for m in done for gap in m.itl],
        "e2el": [m.e2el for m in done],
    }
    for name in LATENCY_NAMES:
        summary.update(_stats_ms(name, series[name]))
    summary.update({
        "input_lens": [m.input_tokens for m in metrics],
        "output_lens": [m.output_tokens for m in metrics],
        "ttfts": [m.ttft for m in metrics],
        "itls": [m.itl for m in metrics],
        "e2els": [m.e2el for m in metrics],
        "errors": [m.error or "" for m in metrics],
    })
    return summary
