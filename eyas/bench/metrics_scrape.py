"""Acceptance statistics from a server's Prometheus `/metrics`, as deltas around a run.

Usage:
    before = await scrape_spec_counters(client, "http://127.0.0.1:8000")
    ...  # run the requests
    after = await scrape_spec_counters(client, "http://127.0.0.1:8000")
    acceptance_from_counters(before, after)
    # {"acceptance_length": 2.9, "acceptance_rate_per_position": [0.8, 0.6, ...], ...}

The counters are vLLM's (eyas serves the same names):
`vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`,
`vllm:spec_decode_num_accepted_tokens` and `vllm:spec_decode_num_accepted_tokens_per_pos`
(label `position`), with or without the `_total` suffix of Prometheus counters; samples that
differ in other labels (engine, model name) are summed.

    acceptance length               = 1 + accepted / drafts   (the bonus token included)
    acceptance rate at position i   = accepted at position i / drafts
    draft acceptance rate           = accepted / draft tokens

A server without `/metrics`, or without these counters, gives None: the benchmark goes on and
reports no acceptance. The deltas also count any other traffic the server had meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

PREFIX = "vllm:spec_decode_"
SCALAR_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POSITION_COUNTER = "num_accepted_tokens_per_pos"
EMPTY_ACCEPTANCE: dict[str, Any] = {
    "acceptance_length": None,
    "acceptance_rate_per_position": None,
    "draft_acceptance_rate": None,
    "spec_decode_num_drafts": None,
    "spec_decode_num_draft_tokens": None,
    "spec_decode_num_accepted_tokens": None,
}


@dataclass
class SpecDecodeCounters:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)

    def minus(self, earlier: SpecDecodeCounters) -> SpecDecodeCounters:
        positions = set(self.accepted_per_position) | set(earlier.accepted_per_position)
        return SpecDecodeCounters(
            num_drafts=self.num_drafts - earlier.num_drafts,
            num_draft_tokens=self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - earlier.num_accepted_tokens,
            accepted_per_position={
                p: self.accepted_per_position.get(p, 0.0) - earlier.accepted_per_position.get(p, 0.0)
                for p in positions
            },
        )


def parse_spec_counters(text: str) -> SpecDecodeCounters | None:
    """The speculative-decoding counters in a Prometheus text page; None if it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = SpecDecodeCounters()
    found = False
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError):  # not a Prometheus text page
        return None
    for sample in samples:
        name = sample.name
        if not name.startswith(PREFIX) or name.endswith("_created"):
            continue
        short = name[len(PREFIX):].removesuffix("_total")
        if short in SCALAR_COUNTERS:
            setattr(counters, short, getattr(counters, short) + float(sample.value))
            found = True
        elif short == PER_POSITION_COUNTER and sample.labels.get("position", "").isdigit():
            position = int(sample.labels["position"])
            per_position = counters.accepted_per_position
            per_position[position] = per_position.get(position, 0.0) + float(sample.value)
            found = True
    return counters if found else None


async def scrape_spec_counters(client: httpx.AsyncClient, base_url: str,
                               timeout: float = 10.0) -> SpecDecodeCounters | None:
    """GET `{base_url}/metrics` and parse it; None when unreachable or without the counters."""
    try:
        response = await client.get(f"{base_url}/metrics", timeout=timeout)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_spec_counters(response.text)


def acceptance_from_counters(before: SpecDecodeCounters | None,
                             after: SpecDecodeCounters | None) -> dict[str, Any]:
    """Acceptance length and per-position rates from two scrapes (None fields when unknown)."""
    if before is None or after is None:
        return dict(EMPTY_ACCEPTANCE)
    delta = after.minus(before)
    if delta.num_drafts <= 0:  # no speculative step in the window (e.g. a plain server)
        return dict(EMPTY_ACCEPTANCE)
    positions = range(max(delta.accepted_per_position, default=-1) + 1)
    return {
        "acceptance_length": 1.0 + delta.num_accepted_tokens / delta.num_drafts,
        "acceptance_rate_per_position": (
            [delta.accepted_per_position.get(p, 0.0) / delta.num_drafts for p in positions]
            or None),
        "draft_acceptance_rate": (delta.num_accepted_tokens / delta.num_draft_tokens
                                  if delta.num_draft_tokens > 0 else None),
        "spec_decode_num_drafts": delta.num_drafts,
        "spec_decode_num_draft_tokens": delta.num_draft_tokens,
        "spec_decode_num_accepted_tokens": delta.num_accepted_tokens,
    }
