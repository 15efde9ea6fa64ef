"""`--workload multiturn`: conversations sent turn by turn with their history (the server's own
answers in it), first turns reported apart from later ones, the prefix cache hit rate."""

from __future__ import annotations

import pytest

from eyas.bench.latency import RequestMetrics
from eyas.bench.multiturn import hit_rate, sharegpt_sessions, turn_summary
from eyas.bench.serve_bench import run_serve_benchmark
from eyas.bench.serve_client import ServeBenchConfig, SweepConfig
from eyas.errors import EyasError
from synthetic_server import Behaviour, SyntheticServer


def test_conversations_go_turn_by_turn_with_their_answers_in_the_history():
    sweep = SweepConfig(workload="multiturn", num_prompts=3, max_turns=3, concurrency=[2],
                        tokenizer="none", warmup=0, max_tokens=4)
    with SyntheticServer(Behaviour(ttft_ms=5, itl_ms=2, tokens=4)) as server:
        run = run_serve_benchmark(ServeBenchConfig(url=server.url, sweep=sweep), progress=False)
        bodies = server.counters.requests
    sessions = sharegpt_sessions(3, 3)
    result = run["results"][0]
    assert result["completed"] == sum(map(len, sessions)) == len(bodies)
    assert result["first_turns"] == 3 and result["later_turns"] == sum(map(len, sessions)) - 3
    assert run["dataset_name"] == "sharegpt-multiturn"
    by_length = sorted(bodies, key=lambda body: len(body["messages"]))
    longest = by_length[-1]["messages"]
    assert [m["role"] for m in longest] == ["user", "assistant"] * (len(longest) // 2) + ["user"]
    assert longest[1]["content"] == " w0 w1 w2 w3"  # the server's streamed answer, sent back
    assert any(session[: (len(longest) + 1) // 2] == [m["content"] for m in longest[::2]]
               for session in sessions)
    assert result["prefix_cache_hit_rate"] is None  # the synthetic server has no such counters


def test_turn_summary_and_hit_rate_values():
    metrics = [RequestMetrics(True, ttft=t) for t in (1.0, 0.2, 0.4, 3.0)] + [RequestMetrics(False)]
    summary = turn_summary(metrics, [1, 2, 3, 1, 2])
    assert (summary["first_turns"], summary["later_turns"]) == (2, 2)
    assert summary["mean_ttft_ms_first_turn"] == pytest.approx(2000.0)
    assert summary["median_ttft_ms_later_turns"] == pytest.approx(300.0)
    assert hit_rate((100.0, 10.0), (300.0, 160.0)) == {
        "prefix_cache_queries": 200.0, "prefix_cache_hits": 150.0, "prefix_cache_hit_rate": 0.75}
    assert hit_rate(None, (1.0, 1.0))["prefix_cache_hit_rate"] is None


@pytest.mark.parametrize("overrides", [{"endpoint": "completions"}, {"max_turns": 1},
                                       {"dataset": "random"}, {"workload": "chat"}])
def test_bad_multiturn_settings_are_refused(overrides):
    settings = {"workload": "multiturn", **overrides}
    with pytest.raises(EyasError):
        SweepConfig(**settings)
