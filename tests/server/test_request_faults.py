"""A fault in one request's work over HTTP: that request gets a 500 with a JSON error (or, on
a stream, an error event and [DONE]), /metrics counts it by stage, and the request beside it
in the same steps gets exactly what it gets alone."""

from __future__ import annotations

import json
import threading

import httpx

from server_support import start_server


def failures(served, stage: str) -> float:
    return served.metrics.failures.labels(model_name=served.name, engine="0", stage=stage)._value.get()


def test_a_faulted_request_fails_alone_over_http(tiny_target):
    served = start_server(tiny_target, draft="ngram:3,1,3")
    url = served.url + "/v1/completions"
    healthy = {"model": "tiny", "prompt": "one two three one two three", "max_tokens": 24,
               "temperature": 0, "ignore_eos": True}
    faulted = {**healthy, "prompt": "a faulted request", "max_tokens": 13}
    try:
        alone = httpx.post(url, json=healthy, timeout=120).json()["choices"][0]["text"]
        served.engine.faults.inject("sample", when=lambda r: r.max_new_tokens == 13 and r.num_output >= 2)
        results = {}
        threads = [
            threading.Thread(target=lambda: results.setdefault("healthy", httpx.post(url, json=healthy, timeout=120))),
            threading.Thread(target=lambda: results.setdefault("plain", httpx.post(url, json=faulted, timeout=120))),
            threading.Thread(target=lambda: results.setdefault("stream", httpx.post(
                url, json={**faulted, "stream": True}, timeout=120))),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert results["healthy"].status_code == 200
        assert results["healthy"].json()["choices"][0]["text"] == alone
        plain = results["plain"]
        assert plain.status_code == 500
        error = plain.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        assert error["message"].startswith("generation failed inside the engine at sample: InjectedFault")
        events = [line[len("data: "):] for line in results["stream"].text.splitlines() if line]
        assert events[-1] == "[DONE]"
        streamed_error = json.loads(events[-2])["error"]
        assert streamed_error["code"] == "internal_error" and "at sample" in streamed_error["message"]
        assert failures(served, "sample") == 2 and failures(served, "prefill") == 0
        text = httpx.get(served.url + "/metrics").text
        assert 'eyas:request_failures_total{engine="0",model_name="tiny",stage="sample"} 2.0' in text
        # the server goes on serving
        served.engine.faults.clear()
        again = httpx.post(url, json=faulted, timeout=120)
        assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
    finally:
        served.server.stop()
