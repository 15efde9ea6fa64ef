"""Latency arithmetic on hand-built chunk timelines (exact), and the /metrics acceptance deltas."""

from __future__ import annotations

import pytest

from eyas.bench.latency import StreamRecord, needs_tokenizer, request_metrics, summarize_level
from eyas.bench.metrics_scrape import (SpecDecodeCounters, acceptance_from_counters,
                                       parse_spec_counters)


def words(text: str) -> int:
    return len(text.split())


def timeline(chunk_times, texts, end, completion_tokens=None, chunk_usage=None) -> StreamRecord:
    return StreamRecord(start=10.0, chunk_times=[10.0 + t for t in chunk_times], chunk_texts=texts,
                        chunk_usage_tokens=chunk_usage or [None] * len(texts), end=10.0 + end,
                        prompt_tokens=7, completion_tokens=completion_tokens)


def test_one_token_per_chunk():
    # TTFT 50 ms, then 4 chunks 20 ms apart; the stream ends 5 ms after the last chunk.
    record = timeline([0.05, 0.07, 0.09, 0.11, 0.13], [" a", " b", " c", " d", " e"], 0.135,
                      completion_tokens=5)
    metrics = request_metrics(record, count_tokens=None)
    assert metrics.success and metrics.output_tokens == 5 and metrics.input_tokens == 7
    assert metrics.ttft == pytest.approx(0.05)
    assert metrics.e2el == pytest.approx(0.135)
    assert metrics.tpot == pytest.approx((0.135 - 0.05) / 4)
    assert metrics.itl == pytest.approx([0.02] * 4)
    assert not needs_tokenizer(record)  # as many tokens as chunks: no tokenizer needed


def test_multi_token_chunks_split_by_tokenizer_counts():
    # First chunk 1 token, then chunks of 3, 2 and 1 tokens after gaps of 30, 20 and 10 ms.
    texts = [" w0", " w1 w2 w3", " w4 w5", " w6"]
    record = timeline([0.05, 0.08, 0.10, 0.11], texts, 0.11, completion_tokens=7)
    assert needs_tokenizer(record)
    metrics = request_metrics(record, count_tokens=words)
    assert metrics.itl == pytest.approx([0.01] * 3 + [0.01] * 2 + [0.01])
    assert metrics.tpot == pytest.approx(0.06 / 6)
    assert sum(metrics.itl) == pytest.approx(metrics.e2el - metrics.ttft)


def test_tokenizer_counts_are_rescaled_to_the_server_total():
    # The benchmark's tokenizer splits twice as finely as the server's: chunk shares are kept,
    # the number of ITL samples is the server's.
    texts = [" w0", " w1 w2 w3", " w4 w5", " w6"]
    record = timeline([0.05, 0.08, 0.10, 0.11], texts, 0.11, completion_tokens=7)
    metrics = request_metrics(record, count_tokens=lambda text: 2 * words(text))
    assert metrics.output_tokens == 7
    assert metrics.itl == pytest.approx([0.01] * 6)


def test_per_chunk_usage_beats_the_tokenizer():
    record = timeline([0.05, 0.08], [" w0", " w1 w2 w3"], 0.08, completion_tokens=4,
                      chunk_usage=[1, 4])
    assert not needs_tokenizer(record)

    def no_tokenizer(text: str) -> int:
        raise AssertionError("the tokenizer must not be used")

    assert request_metrics(record, no_tokenizer).itl == pytest.approx([0.01] * 3)


def test_without_usage_or_tokenizer_one_token_per_chunk():
    record = timeline([0.05, 0.08, 0.09], [" a", " b c", " d"], 0.1)
    metrics = request_metrics(record, count_tokens=None)
    assert metrics.output_tokens == 3  # the number of content chunks
    assert metrics.itl == pytest.approx([0.03, 0.01])
    with_counter = request_metrics(record, count_tokens=words)
    assert with_counter.output_tokens == 4 and with_counter.itl == pytest.approx([0.015, 0.015, 0.01])


def test_failures_and_empty_streams():
    failed = request_metrics(StreamRecord(start=0.0, error="HTTP 500: boom"), None)
    assert not failed.success and failed.error == "HTTP 500: boom"
    empty = request_metrics(StreamRecord(start=0.0, end=0.1, completion_tokens=0), None)
    assert not empty.success and "no content" in empty.error
    single = request_metrics(timeline([0.05], [" a"], 0.06, completion_tokens=1), None)
    assert single.success and single.tpot is None and single.itl == []


def test_level_summary_fields_and_values():
    records = [timeline([0.05 + i * 0.01, 0.07 + i * 0.01], [" a", " b"], 0.08 + i * 0.01,
                        completion_tokens=2) for i in range(4)]
    metrics = [request_metrics(r, None) for r in records]
    metrics.append(request_metrics(StreamRecord(start=0.0, error="timed out"), None))
    summary = summarize_level(metrics, duration=2.0)
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["total_input_tokens"] == 28 and summary["total_output_tokens"] == 8
    assert summary["request_throughput"] == pytest.approx(2.0)
    assert summary["output_throughput"] == pytest.approx(4.0)
    assert summary["total_token_throughput"] == pytest.approx(18.0)
    assert summary["mean_ttft_ms"] == pytest.approx(65.0)  # 50, 60, 70, 80 ms
    assert summary["median_ttft_ms"] == pytest.approx(65.0)
    assert summary["p99_ttft_ms"] == pytest.approx(79.7)  # linear interpolation, as numpy/vLLM
    assert summary["mean_itl_ms"] == pytest.approx(20.0)
    assert summary["mean_tpot_ms"] == pytest.approx(30.0)
    assert summary["p90_e2el_ms"] == pytest.approx(107.0)
    assert summary["errors"][-1] == "timed out" and len(summary["ttfts"]) == 5


def test_level_summary_with_nothing_completed():
    summary = summarize_level([request_metrics(StreamRecord(start=0.0, error="x"), None)], 1.0)
    assert summary["completed"] == 0 and summary["mean_ttft_ms"] is None


PROMETHEUS_PAGE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0"} 80.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0"} 30.0
vllm:spec_decode_num_accepted_tokens_created{engine="0"} 1.7e9
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 16.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 4.0
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
"""


def test_parse_counters_sums_labels_and_ignores_created():
    counters = parse_spec_counters(PROMETHEUS_PAGE)
    assert counters == SpecDecodeCounters(20.0, 80.0, 30.0, {0: 16.0, 1: 10.0, 2: 4.0})
    plain = parse_spec_counters("vllm:spec_decode_num_drafts 3\nvllm:spec_decode_num_accepted_tokens 6\n")
    assert plain.num_drafts == 3.0 and plain.num_accepted_tokens == 6.0


def test_parse_counters_absent_or_not_prometheus():
    assert parse_spec_counters("# TYPE up gauge\nup 1\n") is None
    assert parse_spec_counters("<html><body>Not Found</body></html>") is None
    assert parse_spec_counters("") is None


def test_acceptance_from_deltas_is_exact():
    before = SpecDecodeCounters(20.0, 80.0, 30.0, {0: 16.0, 1: 10.0, 2: 4.0})
    after = SpecDecodeCounters(30.0, 120.0, 55.0, {0: 26.0, 1: 20.0, 2: 9.0})
    acceptance = acceptance_from_counters(before, after)
    assert acceptance["acceptance_length"] == 1.0 + 25.0 / 10.0  # the bonus token included
    assert acceptance["acceptance_rate_per_position"] == [1.0, 1.0, 0.5]
    assert acceptance["draft_acceptance_rate"] == 25.0 / 40.0
    assert acceptance["spec_decode_num_drafts"] == 10.0


def test_acceptance_unknown_without_counters_or_drafts():
    counters = SpecDecodeCounters(5.0, 20.0, 10.0, {})
    assert acceptance_from_counters(None, counters)["acceptance_length"] is None
    assert acceptance_from_counters(counters, None)["acceptance_rate_per_position"] is None
    assert acceptance_from_counters(counters, counters)["acceptance_length"] is None  # no drafts
