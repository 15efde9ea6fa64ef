"""The benchmark client against the synthetic server, whose delays are known.

Lower bounds are exact (the server sleeps at least that long; no client can beat it). Upper
bounds leave room for the loopback round trip on a 2-core machine that other jobs keep busy,
yet catch the mistakes that matter: timing from the level's start or the semaphore queue (TTFT
off by whole requests), ITL per chunk instead of per token (3x). The arithmetic itself is
checked exactly on hand-built timelines in test_latency_math.py.
"""

from __future__ import annotations

import socket

import pytest

from bench_support import ITL_MS, LEVELS, NUM_PROMPTS, PROMPT_WORDS, TOKENS, TTFT_MS, words
from eyas.bench.serve_bench import run_serve_benchmark
from eyas.bench.serve_client import ServeBenchConfig, SweepConfig
from eyas.errors import EyasError
from synthetic_server import Behaviour, SyntheticServer

SLACK_MS = 120.0  # allowed overhead on a latency
LOW, HIGH = 0.9, 1.8  # allowed ratio to the expected per-token time


def sweep_for(prompts_file, **overrides) -> SweepConfig:
    settings = dict(dataset=f"jsonl:{prompts_file}", num_prompts=4, concurrency=[2], tokenizer="none")
    settings.update(overrides)
    return SweepConfig(**settings)


def test_plain_server_latencies(plain_run):
    assert [r["max_concurrency"] for r in plain_run["results"]] == LEVELS
    for result in plain_run["results"]:
        assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
        assert result["total_output_tokens"] == NUM_PROMPTS * TOKENS  # from the usage chunk
        assert result["total_input_tokens"] == NUM_PROMPTS * PROMPT_WORDS
        assert TTFT_MS <= result["mean_ttft_ms"] <= TTFT_MS + SLACK_MS
        assert TTFT_MS <= result["median_ttft_ms"] <= result["p99_ttft_ms"] <= TTFT_MS + 2 * SLACK_MS
        for name in ("tpot", "itl"):
            assert LOW * ITL_MS <= result[f"mean_{name}_ms"] <= HIGH * ITL_MS, name
            assert LOW * ITL_MS <= result[f"median_{name}_ms"] <= HIGH * ITL_MS, name
        assert all(len(itl) == TOKENS - 1 for itl in result["itls"])
        # Both come from the same chunk times: per token, they agree whatever the load.
        assert result["mean_itl_ms"] == pytest.approx(result["mean_tpot_ms"], rel=0.15)
        for ttft, itl, e2el in zip(result["ttfts"], result["itls"], result["e2els"]):
            assert ttft + sum(itl) <= e2el + 1e-9
        e2el_ms = TTFT_MS + (TOKENS - 1) * ITL_MS
        assert e2el_ms <= result["mean_e2el_ms"] <= e2el_ms * HIGH
        assert result["acceptance_length"] is None  # a plain server has no speculative counters


def test_plain_server_throughput(plain_run):
    request_seconds = (TTFT_MS + (TOKENS - 1) * ITL_MS) / 1000
    for result in plain_run["results"]:
        # All prompts in waves of `concurrency` requests: the best possible rate, never beaten.
        best = result["max_concurrency"] / request_seconds
        assert 0.4 * best <= result["request_throughput"] <= 1.01 * best
        assert result["output_throughput"] == pytest.approx(result["request_throughput"] * TOKENS)
        assert result["duration"] == pytest.approx(NUM_PROMPTS / result["request_throughput"])
    low, high = plain_run["results"]
    assert high["output_throughput"] > 2 * low["output_throughput"]


def test_multi_token_chunks_attribute_itl_and_give_acceptance(prompts_file):
    # 16 tokens: 1 in the first chunk, then 5 chunks of 3 tokens every 30 ms -> 10 ms per token.
    behaviour = Behaviour(ttft_ms=TTFT_MS, itl_ms=30, tokens=16, tokens_per_chunk=3, draft_len=4,
                          spec_metrics=True, usage=False)
    with SyntheticServer(behaviour) as server:
        run = run_serve_benchmark(ServeBenchConfig(url=server.url, sweep=sweep_for(prompts_file)),
                                  progress=False, count_tokens=words)
        drafts_sent = server.counters.drafts
    result = run["results"][0]
    assert result["completed"] == 4 and result["total_output_tokens"] == 4 * 16  # counted
    assert all(len(itl) == 15 for itl in result["itls"])
    assert LOW * 10 <= result["median_itl_ms"] <= HIGH * 10
    assert LOW * 10 <= result["mean_tpot_ms"] <= HIGH * 10
    # Exactly: 4 requests x 5 drafts, 2 of 4 draft tokens accepted each (warm-up not counted).
    assert result["spec_decode_num_drafts"] == 20.0 and drafts_sent == 20 + 2 * 5
    assert result["acceptance_length"] == 3.0
    assert result["acceptance_rate_per_position"] == [1.0, 1.0, 0.0, 0.0]
    assert result["draft_acceptance_rate"] == 0.5


def test_continuous_usage_gives_tokens_per_chunk(prompts_file):
    behaviour = Behaviour(ttft_ms=10, itl_ms=30, tokens=7, tokens_per_chunk=3, usage=False)

    def no_tokenizer(text: str) -> int:
        raise AssertionError("per-chunk usage must make the tokenizer unnecessary")

    with SyntheticServer(behaviour) as server:
        sweep = sweep_for(prompts_file, continuous_usage_stats=True)
        run = run_serve_benchmark(ServeBenchConfig(url=server.url, sweep=sweep), progress=False,
                                  count_tokens=no_tokenizer)
        assert server.counters.requests[-1]["stream_options"]["continuous_usage_stats"] is True
    result = run["results"][0]
    assert result["output_lens"] == [7] * 4 and all(len(itl) == 6 for itl in result["itls"])
    assert LOW * 10 <= result["median_itl_ms"] <= HIGH * 10


def test_completions_endpoint_and_request_body(prompts_file):
    with SyntheticServer(Behaviour(ttft_ms=5, itl_ms=5, tokens=6)) as server:
        sweep = sweep_for(prompts_file, endpoint="completions", max_tokens=4, temperature=0.5,
                          ignore_eos=True)
        run = run_serve_benchmark(ServeBenchConfig(url=server.url + "/v1/", sweep=sweep),
                                  progress=False)
        body = server.counters.requests[-1]
    assert run["backend"] == "openai" and run["endpoint"] == "/v1/completions"
    assert run["results"][0]["output_lens"] == [4] * 4  # max_tokens caps the synthetic 6
    assert body["prompt"].startswith("please answer") and body["stream"] is True
    assert body["max_tokens"] == 4 and body["temperature"] == 0.5 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "synthetic-model"  # found through /v1/models


def test_missing_metrics_endpoint_degrades_gracefully(prompts_file):
    behaviour = Behaviour(ttft_ms=5, itl_ms=5, tokens=4, tokens_per_chunk=2, spec_metrics=True,
                          metrics_endpoint=False)
    with SyntheticServer(behaviour) as server:
        run = run_serve_benchmark(ServeBenchConfig(url=server.url, sweep=sweep_for(prompts_file)),
                                  progress=False)
    result = run["results"][0]
    assert result["completed"] == 4
    assert result["acceptance_length"] is None and result["acceptance_rate_per_position"] is None


def test_unknown_model_fails_at_warm_up(prompts_file):
    with SyntheticServer(Behaviour(ttft_ms=1, itl_ms=1, tokens=2)) as server:
        config = ServeBenchConfig(url=server.url, model="no-such-model", sweep=sweep_for(prompts_file))
        with pytest.raises(EyasError, match="every warm-up request.*HTTP 404.*no-such-model"):
            run_serve_benchmark(config, progress=False)


def test_unreachable_server(prompts_file):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(EyasError, match="cannot reach http://127.0.0.1"):
        run_serve_benchmark(ServeBenchConfig(url=f"http://127.0.0.1:{port}",
                                             sweep=sweep_for(prompts_file)), progress=False)


def test_request_and_level_time_limits(prompts_file):
    with SyntheticServer(Behaviour(ttft_ms=400, itl_ms=1, tokens=2)) as server:
        too_slow = sweep_for(prompts_file, warmup=0, request_timeout=0.1)
        with pytest.raises(EyasError, match="no request .* completed; first error: timed out"):
            run_serve_benchmark(ServeBenchConfig(url=server.url, sweep=too_slow), progress=False)
        # One request in flight, 0.4 s each, 1 s for the level: 2 finish (1 on a busy
        # machine), the others are cancelled.
        limited = sweep_for(prompts_file, warmup=0, concurrency=[1], level_timeout=1.0)
        result = run_serve_benchmark(ServeBenchConfig(url=server.url, sweep=limited),
                                     progress=False)["results"][0]
    assert 1 <= result["completed"] <= 2 and result["failed"] == 4 - result["completed"]
    assert "--level-timeout" in result["errors"][-1]
    assert result["duration"] == pytest.approx(1.0, abs=0.3)


@pytest.mark.parametrize("overrides, message", [
    ({"concurrency": []}, "--concurrency"),
    ({"concurrency": [0, 2]}, "--concurrency"),
    ({"dataset": "alpaca"}, "accepted: mtbench, sharegpt, random, jsonl:PATH"),
    ({"endpoint": "responses"}, "accepted: chat, completions"),
    ({"num_prompts": 0}, "--num-prompts"),
    ({"temperature": 3.0}, "--temperature"),
])
def test_sweep_config_rejects_bad_values(overrides, message):
    with pytest.raises(EyasError, match=message):
        SweepConfig(**overrides)


def test_url_is_checked_and_normalised():
    assert ServeBenchConfig(url="http://127.0.0.1:8000/v1/").url == "http://127.0.0.1:8000"
    with pytest.raises(EyasError, match="http://HOST:PORT"):
        ServeBenchConfig(url="127.0.0.1:8000")


@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_both_clients_record_the_same_stream(prompts_file, client):
    behaviour = Behaviour(ttft_ms=20, itl_ms=10, tokens=6, tokens_per_chunk=2)
    with SyntheticServer(behaviour) as server:
        run = run_serve_benchmark(ServeBenchConfig(url=server.url, sweep=sweep_for(prompts_file, client=client)),
                                  progress=False, count_tokens=words)
    result = run["results"][0]
    assert run["client"] == client
    assert result["completed"] == 4 and result["output_lens"] == [6] * 4
    assert LOW * 5 <= result["median_itl_ms"] <= HIGH * 5  # 2 tokens per 10 ms chunk
    assert 0 < result["client_cpu_s"] and result["client_cpu_ms_per_output_token"] > 0


def test_unknown_client_is_refused():
    with pytest.raises(EyasError, match="unknown client 'curl'; accepted: raw, httpx"):
        SweepConfig(client="curl")
