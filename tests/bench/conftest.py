"""Fixtures of the serving benchmark tests: a prompt file, and one measured sweep against the
synthetic server (TTFT 50 ms, 20 ms between tokens, 12 tokens) shared by the tests that read it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench_support import ITL_MS, LEVELS, NUM_PROMPTS, TOKENS, TTFT_MS
from synthetic_server import Behaviour, SyntheticServer


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"please answer question {i}"}) + "\n"
                            for i in range(NUM_PROMPTS)))
    return path


@pytest.fixture(scope="session")
def plain_run(prompts_file) -> dict[str, Any]:
    """A sweep at concurrency 1 and 4 against the plain synthetic server."""
    from eyas.bench.serve_bench import run_serve_benchmark
    from eyas.bench.serve_client import ServeBenchConfig, SweepConfig

    sweep = SweepConfig(dataset=f"jsonl:{prompts_file}", num_prompts=NUM_PROMPTS, concurrency=LEVELS,
                        tokenizer="none")
    with SyntheticServer(Behaviour(ttft_ms=TTFT_MS, itl_ms=ITL_MS, tokens=TOKENS)) as server:
        return run_serve_benchmark(ServeBenchConfig(url=server.url, label="plain", sweep=sweep),
                                   progress=False)
