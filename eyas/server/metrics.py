"""Prometheus metrics under vLLM's names, so that existing dashboards and scrapers read them.

| metric (exposition name)                                   | kind      | meaning |
|------------------------------------------------------------|-----------|---------|
| vllm:time_to_first_token_seconds                           | histogram | arrival -> first token |
| vllm:time_per_output_token_seconds                         | histogram | (finish - first token) / (completion tokens - 1), per request |
| vllm:e2e_request_latency_seconds                           | histogram | arrival -> finish |
| vllm:num_requests_running / vllm:num_requests_waiting      | gauge     | holding a KV row / queued |
| vllm:prompt_tokens_total / vllm:generation_tokens_total    | counter   | tokens in / out |
| vllm:request_success_total{finished_reason}                | counter   | finished requests (stop, length, abort, error) |
| vllm:spec_decode_num_drafts_total                          | counter   | verifications of a non-empty draft |
| vllm:spec_decode_num_draft_tokens_total                    | counter   | draft tokens verified |
| vllm:spec_decode_num_accepted_tokens_total                 | counter   | draft tokens accepted |
| vllm:spec_decode_num_accepted_tokens_per_pos_total{position} | counter | drafts accepted at depth position + 1 (0-based) |
| eyas:spec_decode_draft_tokens_per_request                  | gauge     | k the policy chose for the last step (0 = plain) |
| eyas:suffix_store_bytes / eyas:suffix_store_max_bytes      | gauge     | `--draft suffix`: the global store's estimated size / its bound |
| eyas:suffix_store_documents / eyas:suffix_store_tokens     | gauge     | earlier requests' outputs held / their tokens |
| eyas:suffix_store_evictions_total                          | counter   | documents evicted (least recently used first) |
| eyas:suffix_store_lookups_total / eyas:suffix_store_hits_total | counter | proposals that searched the store / found a continuation there |
| eyas:request_failures_total{stage}                         | counter   | requests ended by a fault in their own work, by stage (eyas/scheduler/faults.py) |
| eyas:requests_rejected_total{reason}                       | counter   | requests refused with 503: queue_full, shutting_down |
| eyas:kv_rows_in_use / eyas:kv_rows                         | gauge     | KV cache rows held by requests / rows in the pool (0 in use when idle) |
| eyas:kv_cache_slots                                        | gauge     | token slots per KV row (grows on demand, kept) |
| eyas:kv_cache_bytes                                        | gauge     | bytes of the KV pool as allocated |
| vllm:kv_cache_usage_perc                                   | gauge     | rows in use / rows (0..1) |
| vllm:prefix_cache_queries / vllm:prefix_cache_hits         | counter   | prompt tokens looked up in the prefix cache / of those, reused (hit rate = hits / queries) |
| eyas:prefix_cache_rows / eyas:prefix_cache_tokens          | gauge     | cached prefixes resident in KV rows no request holds / their tokens |
| eyas:prefix_cache_evictions_total                          | counter   | cached prefixes evicted (least recently used first) |

Mean acceptance length = 1 + accepted / drafts (the bonus token counts).
Names: a metric vLLM also exports keeps vLLM's name (`vllm:` prefix), so that its dashboards read
eyas; one that only eyas has is `eyas:`. Counters are declared without `_total`, which the
exposition adds (vllm:prefix_cache_hits -> vllm:prefix_cache_hits_total, as vLLM's own).
Every series carries model_name and engine="0" labels, as vLLM's do.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from eyas.scheduler.executor import StepStats
from eyas.scheduler.faults import FAILURE_LABELS
from eyas.scheduler.prefix_cache import PrefixCacheStats
from eyas.scheduler.request import Request

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
REJECT_REASONS = ("queue_full", "shutting_down")
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """The engine's observer: fed from the engine thread, read by GET /metrics."""

    def __init__(self, model_name: str, num_positions: int = 0) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.label_values = {"model_name": model_name, "engine": "0"}
        self._children: dict[tuple, Any] = {}  # _l
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token after "
                              "the first, per request", labels, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests holding a KV row", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", labels + ["finished_reason"],
                               registry=r)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Verified drafts", labels, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Verified draft tokens",
                                    labels, registry=r)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens",
                                       labels, registry=r)
        self.accepted_per_position = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted draft tokens by position (0-based)",
                                             labels + ["position"], registry=r)
        self.draft_length = Gauge("eyas:spec_decode_draft_tokens_per_request",
                                  "Draft tokens per request chosen for the last step (0 = plain)",
                                  labels, registry=r)
        self.failures = Counter("eyas:request_failures", "Requests ended by a fault in their own "
                                "work, by stage", labels + ["stage"], registry=r)
        self.rejected = Counter("eyas:requests_rejected", "Requests refused with 503",
                                labels + ["reason"], registry=r)
        self.kv_rows_in_use = Gauge("eyas:kv_rows_in_use", "KV cache rows held by requests",
                                    labels, registry=r)
        self.kv_rows = Gauge("eyas:kv_rows", "KV cache rows in the pool", labels, registry=r)
        self.kv_slots = Gauge("eyas:kv_cache_slots", "Token slots per KV cache row", labels, registry=r)
        self.kv_bytes = Gauge("eyas:kv_cache_bytes", "Bytes of the KV cache pool as allocated",
                              labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache rows in use / rows (0..1)",
                              labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in "
                                      "prompt tokens", labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens "
                                   "reused", labels, registry=r)
        self.prefix_rows = Gauge("eyas:prefix_cache_rows", "Cached prefixes resident in KV rows",
                                 labels, registry=r)
        self.prefix_tokens = Gauge("eyas:prefix_cache_tokens", "Tokens of the cached prefixes",
                                   labels, registry=r)
        self.prefix_evictions = Counter("eyas:prefix_cache_evictions", "Cached prefixes evicted "
                                        "(least recently used first)", labels, registry=r)
        self._evictions_seen = 0
        self.store_stats: Callable[[], dict[str, int]] | None = None  # watch_suffix_store
        self.store_gauges: dict[str, Gauge] = {}
        for reason in ("stop", "length", "abort", "error"):  # exported from the start, at 0
            self.success.labels(**self.label_values, finished_reason=reason)
        for stage in FAILURE_LABELS:
            self._l(self.failures, stage=stage)
        for reason in REJECT_REASONS:
            self._l(self.rejected, reason=reason)
        for metric in (self.drafts, self.draft_tokens, self.accepted_tokens, self.prompt_tokens,
                       self.generation_tokens, self.running, self.waiting, self.draft_length,
                       self.kv_rows_in_use, self.kv_rows, self.kv_slots, self.kv_bytes, self.kv_usage,
                       self.prefix_queries, self.prefix_hits, self.prefix_rows, self.prefix_tokens,
                       self.prefix_evictions):
            metric.labels(**self.label_values)
        for position in range(num_positions):
            self._l(self.accepted_per_position, position=str(position))

    def _l(self, metric, **extra):
        """The metric's child for this model (and `extra` labels), looked up once: the engine
        thread updates several gauges after every step."""
        key = (id(metric), *extra.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.label_values, **extra)
        return child

    # ---- EngineObserver --------------------------------------------------------------
    def step_finished(self, stats: StepStats) -> None:
        if stats.decode_rows:
            self._l(self.draft_length).set(stats.planned_draft_tokens)
        if stats.prefix_cache_queries:
            self._l(self.prefix_queries).inc(stats.prefix_cache_queries)
            self._l(self.prefix_hits).inc(stats.prefix_cache_hits)
        if stats.drafts:
            self._l(self.drafts).inc(stats.drafts)
            self._l(self.draft_tokens).inc(stats.draft_tokens)
            self._l(self.accepted_tokens).inc(stats.accepted_tokens)
            for position, count in enumerate(stats.accepted_per_position):
                if count:
                    self._l(self.accepted_per_position, position=str(position)).inc(count)

    def request_finished(self, request: Request) -> None:
        self._l(self.success, finished_reason=request.finish_reason or "stop").inc()
        self._l(self.generation_tokens).inc(request.completion_tokens)
        if request.failure is not None:
            self._l(self.failures, stage=request.failure.stage).inc()
        if request.first_token_time is None:
            return
        self._l(self.prompt_tokens).inc(request.prompt_len)
        end = request.finish_time or request.first_token_time
        self._l(self.ttft).observe(request.first_token_time - request.arrival_time)
        self._l(self.e2e).observe(end - request.arrival_time)
        if request.completion_tokens > 1:
            self._l(self.tpot).observe((end - request.first_token_time) / (request.completion_tokens - 1))

    def queue_changed(self, running: int, waiting: int) -> None:
        self._l(self.running).set(running)
        self._l(self.waiting).set(waiting)

    def kv_changed(self, rows_in_use: int, rows: int, slots: int, cache_bytes: int) -> None:
        self._l(self.kv_rows_in_use).set(rows_in_use)
        self._l(self.kv_rows).set(rows)
        self._l(self.kv_slots).set(slots)
        self._l(self.kv_bytes).set(cache_bytes)
        self._l(self.kv_usage).set(rows_in_use / rows if rows else 0.0)

    def prefix_cache_changed(self, stats: PrefixCacheStats) -> None:
        self._l(self.prefix_rows).set(stats.rows)
        self._l(self.prefix_tokens).set(stats.tokens)
        if stats.evictions > self._evictions_seen:
            self._l(self.prefix_evictions).inc(stats.evictions - self._evictions_seen)
            self._evictions_seen = stats.evictions

    def request_rejected(self, reason: str) -> None:
        """A request refused before the engine took it (HTTP 503)."""
        self._l(self.rejected, reason=reason).inc()

    def watch_suffix_store(self, stats: Callable[[], dict[str, int]]) -> None:
        """Export the suffix-decoding store's size and hit counts (read at every scrape)."""
        self.store_stats = stats
        names = {"bytes": "estimated size in bytes", "max_bytes": "size bound in bytes",
                 "documents": "earlier outputs held", "tokens": "tokens of the outputs held",
                 "evictions_total": "documents evicted", "lookups_total": "proposals that "
                 "searched the store", "hits_total": "proposals that found a continuation there"}
        for name, text in names.items():
            # the *_total series are counts the store keeps itself: exported as gauges named
            # like counters, so that rate() reads them
            self.store_gauges[name] = Gauge(f"eyas:suffix_store_{name}", f"Suffix store: {text}",
                                            ["model_name", "engine"], registry=self.registry)

    def exposition(self) -> bytes:
        if self.store_stats is not None:
            stats = self.store_stats()
            for name, gauge in self.store_gauges.items():
                gauge.labels(**self.label_values).set(stats[name.removesuffix("_total")])
        return generate_latest(self.registry)
