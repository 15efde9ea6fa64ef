"""`eyas bench serve` as a function: prompts -> sweep -> token counts and latencies -> run record.

Usage:
    from eyas.bench.serve_bench import run_serve_benchmark
    from eyas.bench.serve_client import ServeBenchConfig, SweepConfig
    run = run_serve_benchmark(ServeBenchConfig(url="http://127.0.0.1:8000", label="plain"))
    write_run(run, "runs/bench/plain")          # eyas.bench.report: JSON, markdown, plots

The run record is one JSON object: what was run (label, date, machine, command, server URL,
model, dataset, sampling) and `results`, one entry per concurrency level with vLLM's field names
(`completed`, `request_throughput`, `output_throughput`, `mean_ttft_ms`, `p99_itl_ms`, ...)
plus `max_concurrency` and the acceptance statistics from `/metrics`.
"""

from __future__ import annotations

import asyncio
import os
import platform
import shlex
import sys
from datetime import datetime
from typing import Any

from eyas.bench.datasets import load_bench_prompts
from eyas.bench.latency import TokenCounter, needs_tokenizer, request_metrics, summarize_level
from eyas.bench.metrics_scrape import acceptance_from_counters
from eyas.bench.serve_client import ENDPOINTS, LevelRecords, ServeBenchConfig, run_sweep
from eyas.errors import EyasError


class LazyTokenizer:
    """Loads the tokenizer named by `--tokenizer` on first use only ("none": never)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._tokenizer: Any = None

    def get(self) -> Any:
        if self.spec.lower() == "none":
            return None
        if self._tokenizer is None:
            from eyas.models.tokenizer import load_tokenizer

            try:
                self._tokenizer = load_tokenizer(self.spec)
            except EyasError:
                raise
            except Exception as error:  # a hub id without network, a folder without tokenizer
                raise EyasError(f"cannot load tokenizer '{self.spec}' ({type(error).__name__}: "
                                f"{error}); pass a local model (the server's target) or "
                                f"--tokenizer none") from error
        return self._tokenizer

    def counter(self) -> TokenCounter | None:
        tokenizer = self.get()
        if tokenizer is None:
            return None
        return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def machine_description() -> str:
    """The client machine (the server may be elsewhere)."""
    processor = platform.processor() or platform.machine()
    return f"{processor}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def summarize(level: LevelRecords, count_tokens: TokenCounter | None) -> dict[str, Any]:
    metrics = [request_metrics(record, count_tokens) for record in level.records]
    summary = {"max_concurrency": level.concurrency,
               **summarize_level(metrics, level.duration),
               **acceptance_from_counters(level.counters_before, level.counters_after)}
    if level.client_cpu_s is not None:  # the load generator's own CPU (it may share the server's cores)
        summary["client_cpu_s"] = level.client_cpu_s
        tokens = summary["total_output_tokens"]
        summary["client_cpu_ms_per_output_token"] = 1e3 * level.client_cpu_s / tokens if tokens else None
    if level.turns is not None:  # multiturn: first turns apart from the later ones
        from eyas.bench.multiturn import hit_rate, turn_summary

        summary["turns"] = list(level.turns)  # of each record, in the order of the lists below
        summary.update(turn_summary(metrics, level.turns))
        summary.update(hit_rate(level.prefix_before, level.prefix_after))
    return summary


def run_serve_benchmark(config: ServeBenchConfig, progress: bool = True,
                        count_tokens: TokenCounter | None = None) -> dict[str, Any]:
    """Run the sweep of `config` and return the run record (see the module docstring).

    `count_tokens` replaces the `--tokenizer` for counts the server does not report.
    """
    from eyas import __version__

    sweep = config.sweep
    tokenizer = LazyTokenizer(sweep.tokenizer)
    # 1. Prompts (multiturn: one conversation's user turns per prompt, sent one by one).
    if sweep.workload == "multiturn":
        from eyas.bench.datasets import BenchPrompt
        from eyas.bench.multiturn import sharegpt_sessions

        sessions = sharegpt_sessions(sweep.num_prompts, sweep.max_turns)
        prompts = [BenchPrompt(tuple({"role": "user", "content": turn} for turn in session), None)
                   for session in sessions]
    else:
        prompts = load_bench_prompts(sweep.dataset, sweep.num_prompts,
                                     tokenizer=tokenizer.get() if sweep.dataset == "random" else None,
                                     input_len=sweep.input_len, seed=sweep.seed)
    if sweep.endpoint == "completions" and any(p.text is None for p in prompts) and \
            sweep.workload == "single":
        raise EyasError(f"dataset '{sweep.dataset}' has multi-message records, which only "
                        f"--endpoint chat can send")
    if sweep.num_prompts < max(sweep.concurrency):
        print(f"[eyas] note: {sweep.num_prompts} prompts cannot keep {max(sweep.concurrency)} "
              f"requests in flight; use --num-prompts >= 2x the highest concurrency")
    # 2. The sweep (network only; nothing is tokenized while streams run).
    model, levels = asyncio.run(run_sweep(config, prompts, progress))
    # 3. Token counts and latencies, after the fact.
    if count_tokens is None and any(needs_tokenizer(r) for level in levels for r in level.records):
        count_tokens = tokenizer.counter()
    results = [summarize(level, count_tokens) for level in levels]
    if all(result["completed"] == 0 for result in results):
        first_error = next((e for result in results for e in result["errors"] if e), "unknown")
        raise EyasError(f"no request to {config.url} completed; first error: {first_error}")
    return {
        "label": config.label,
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "machine": machine_description(),
        "command": shlex.join(sys.argv),
        "eyas_version": __version__,
        "backend": "openai-chat" if sweep.endpoint == "chat" else "openai",
        "base_url": config.url,
        "endpoint": ENDPOINTS[sweep.endpoint],
        "model_id": model,
        "tokenizer_id": sweep.tokenizer,
        "dataset_name": "sharegpt-multiturn" if sweep.workload == "multiturn" else sweep.dataset,
        "workload": sweep.workload,
        "client": sweep.client,
        "num_prompts": sweep.num_prompts,
        "max_tokens": sweep.max_tokens,
        "temperature": sweep.temperature,
        "ignore_eos": sweep.ignore_eos,
        "warmup": sweep.warmup,
        "request_rate": "inf",
        "concurrency_levels": list(sweep.concurrency),
        "results": results,
    }

