"""/metrics: vLLM-named counters, histograms and gauges move as requests are served."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server_support import start_server


def scrape(served) -> dict[tuple[str, tuple], float]:
    text = httpx.get(served.url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine")))
            values[(sample.name, labels)] = sample.value
    return values


def delta(after, before, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_counters_move_with_served_requests(tiny_target):
    # The target drafting for itself: every draft is accepted, so the counters are exact.
    served = start_server(tiny_target, draft="self", num_draft_tokens=3)
    try:
        client = served.client()
        before = scrape(served)
        for question in ["one", "two", "three"]:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                           max_tokens=13, temperature=0)
        after = scrape(served)
    finally:
        served.server.stop()
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == 3
    assert delta(after, before, "vllm:generation_tokens_total") == 3 * 13
    assert delta(after, before, "vllm:prompt_tokens_total") > 0
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:time_per_output_token_seconds"):
        assert delta(after, before, histogram + "_count") == 3
    drafts = delta(after, before, "vllm:spec_decode_num_drafts_total")
    draft_tokens = delta(after, before, "vllm:spec_decode_num_draft_tokens_total")
    accepted = delta(after, before, "vllm:spec_decode_num_accepted_tokens_total")
    per_position = [delta(after, before, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                          position=str(p)) for p in range(3)]
    # 12 tokens after the first, 3 drafts + 1 bonus per step: 3 full steps per request
    assert drafts == 9 and draft_tokens == 27 and accepted == 27
    assert per_position == [9, 9, 9] and sum(per_position) == accepted
    assert after[("vllm:num_requests_running", ())] == 0
    assert after[("vllm:num_requests_waiting", ())] == 0


def test_plain_server_reports_no_drafts(tiny_plain_server):
    before = scrape(tiny_plain_server)
    tiny_plain_server.client().completions.create(model="tiny", prompt="a b", max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    after = scrape(tiny_plain_server)
    assert delta(after, before, "vllm:spec_decode_num_drafts_total") == 0
    assert delta(after, before, "vllm:generation_tokens_total") == 5


def test_prefix_cache_counters_after_known_requests(tiny_target):
    """A prompt, then the same prompt again and an extension of it: the counters read the
    tokens looked up and reused, as vLLM names them."""
    served = start_server(tiny_target, max_running=2)
    try:
        client = served.client()
        before = scrape(served)
        prompt = [100 + i for i in range(30)]
        first = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
        again = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
        longer = prompt + [400, 401]
        client.completions.create(model="tiny", prompt=longer, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
        after = scrape(served)
    finally:
        served.server.stop()
    assert first.choices[0].text == again.choices[0].text
    assert delta(after, before, "vllm:prefix_cache_queries_total") == 30 + 30 + 32
    # the repeat reuses 29 (the last prompt token is always computed); the longer prompt finds
    # the first request's row (30 prompt tokens + 4 of its 5 answer tokens), of which only
    # the 30 of its prompt match, or the repeat's row: 30 either way
    assert delta(after, before, "vllm:prefix_cache_hits_total") == 29 + 30
    assert after[("eyas:prefix_cache_rows", ())] >= 1
    assert after[("eyas:prefix_cache_tokens", ())] >= 34
    assert after[("eyas:prefix_cache_evictions_total", ())] == 0
