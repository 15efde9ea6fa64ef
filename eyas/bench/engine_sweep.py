"""Closed-loop sweeps of the serving engine in-process, one engine per drafting candidate:
the measurements behind `eyas recommend`.

At each concurrency C, C requests are kept in flight until every prompt is answered
(`eyas.scheduler.measure.run_closed_loop`; the prompt list repeats to at least 2C requests).
The candidates run one after the other at the same level, `rounds` times, the order rotated each
round, so that noise from a shared machine hits all alike; tokens/s is the median over rounds.
Acceptance comes from an engine observer that sums every finished request's verification steps
and accepted draft tokens: tau = 1 + accepted / steps (the bonus token counts).

Usage:
    from eyas.bench.engine_sweep import Candidate, sweep, workload_prompts
    prompts = workload_prompts("mtbench", 8, target.tokenizer)
    measurements = sweep(target, prompts, [Candidate("none"), Candidate("ngram", 4)],
                         concurrency=[1, 4], max_tokens=64, rounds=3, speculation="always")
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from eyas.bench.recommend import Measurement
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import Target
from eyas.errors import EyasError

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Candidate:
    method: str  # a --draft spec: none, ngram[:...], model:M, self, eagle3:DIR
    num_draft_tokens: int | None = None  # most draft tokens per request per step; None for plain

    @property
    def label(self) -> str:
        return self.method if self.method == "none" else f"{self.method} k={self.num_draft_tokens}"


class AcceptanceCounter:
    """An EngineObserver that sums the speculative statistics of finished requests."""

    def __init__(self) -> None:
        self.steps = 0
        self.accepted = 0

    def reset(self) -> None:
        self.steps, self.accepted = 0, 0

    def step_finished(self, stats: Any) -> None:
        pass

    def request_finished(self, request: Any) -> None:
        self.steps += request.spec_metrics.steps
        self.accepted += request.spec_metrics.accepted

    def queue_changed(self, running: int, waiting: int) -> None:
        pass

    def kv_changed(self, rows_in_use: int, rows: int, slots: int, cache_bytes: int) -> None:
        pass


def workload_prompts(spec: str, num_prompts: int, tokenizer: Any) -> list[list[int]]:
    """Chat-templated prompt ids of a workload: code (eyas.bench.prompts) or any set of
    eyas.bench.datasets (mtbench, sharegpt, random, jsonl:PATH)."""
    from eyas.bench.datasets import BenchPrompt, load_bench_prompts
    from eyas.bench.prompts import CODE_PROMPTS
    from eyas.models.tokenizer import chat_prompt_ids

    if spec == "code":
        prompts = [BenchPrompt.from_text(CODE_PROMPTS[i % len(CODE_PROMPTS)])
                   for i in range(num_prompts)]
    else:
        prompts = load_bench_prompts(spec, num_prompts, tokenizer=tokenizer)
    return [chat_prompt_ids(tokenizer, list(prompt.messages)) for prompt in prompts]


def _build_engine(target: Target, candidate: Candidate, max_running: int,
                  speculation: str) -> tuple[Any, AcceptanceCounter]:
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine

    counter = AcceptanceCounter()
    config = EngineConfig(max_running=max_running, speculation=speculation,
                          num_draft_tokens=candidate.num_draft_tokens or 1,
                          prefix_caching=False)  # the prompts repeat: measure decoding, not reuse
    return Engine(target, config, draft=candidate.method, observer=counter), counter


def _check_fit(engine: Any, prompts: list[list[int]], max_tokens: int) -> None:
    from eyas.scheduler.engine import RequestRejected

    for index, prompt in enumerate(prompts):
        try:
            engine.check_lengths(len(prompt), max_tokens)
        except RequestRejected as error:
            raise EyasError(f"prompt {index + 1} does not fit: {error}; use shorter prompts or a "
                            f"smaller --max-tokens") from None


def sweep(target: Target, prompts: list[list[int]], candidates: list[Candidate],
          concurrency: list[int], max_tokens: int, rounds: int, speculation: str = "always",
          progress: Callable[[str], None] | None = None) -> list[Measurement]:
    """One Measurement per (concurrency, candidate); `candidates` must include Candidate('none')."""
    from eyas.scheduler.measure import run_closed_loop

    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    params = SamplingParams(max_tokens=max_tokens)
    engines: dict[Candidate, tuple[Any, AcceptanceCounter]] = {}
    try:
        for candidate in candidates:
            engines[candidate] = _build_engine(target, candidate, max(concurrency), speculation)
        first_engine = next(iter(engines.values()))[0]
        _check_fit(first_engine, prompts, max_tokens)
        for engine, _ in engines.values():  # first-call allocations, kernel selection
            warmup = SamplingParams(max_tokens=min(WARMUP_TOKENS, max_tokens))
            run_closed_loop(engine, prompts[:1], warmup, 1)
        measurements: list[Measurement] = []
        total, done, started = len(concurrency) * rounds * len(candidates), 0, time.perf_counter()
        for level in concurrency:
            level_prompts = prompts * max(1, -(-2 * level // len(prompts)))
            runs: dict[Candidate, list[dict]] = {candidate: [] for candidate in candidates}
            for round_index in range(rounds):
                shift = round_index % len(candidates)
                for candidate in candidates[shift:] + candidates[:shift]:
                    engine, counter = engines[candidate]
                    counter.reset()
                    store = engine.proposers.suffix_store()
                    if store is not None:  # suffix decoding: earlier rounds' answers must not help
                        store.clear()
                    run = run_closed_loop(engine, level_prompts, params, level)
                    run.update(steps=counter.steps, accepted=counter.accepted)
                    runs[candidate].append(run)
                    done += 1
                    tau = f", tau {1 + counter.accepted / counter.steps:.2f}" if counter.steps else ""
                    say(f"[recommend {done}/{total}, {time.perf_counter() - started:.0f} s] "
                        f"concurrency {level}, round {round_index + 1}/{rounds}, {candidate.label}: "
                        f"{run['tokens_per_s']:.1f} tok/s{tau}")
            plain_outputs = runs[Candidate("none")][0]["outputs"]
            for candidate, candidate_runs in runs.items():
                outputs = candidate_runs[0]["outputs"]
                median = statistics.median(run["tokens_per_s"] for run in candidate_runs)
                measurements.append(Measurement(
                    concurrency=level, method=candidate.method,
                    num_draft_tokens=candidate.num_draft_tokens,
                    tokens_per_s=round(median, 3),
                    rounds_tokens_per_s=tuple(round(run["tokens_per_s"], 3) for run in candidate_runs),
                    requests=len(level_prompts), tokens=candidate_runs[0]["tokens"],
                    verification_steps=sum(run["steps"] for run in candidate_runs),
                    accepted_tokens=sum(run["accepted"] for run in candidate_runs),
                    outputs_equal_to_plain=sum(a == b for a, b in zip(outputs, plain_outputs))))
        return measurements
    finally:
        for engine, _ in engines.values():
            engine.shutdown()
