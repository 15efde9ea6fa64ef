"""Every bad input gets its status and an OpenAI-style body naming the field; the server keeps
serving everyone else through all of it."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from server_support import start_server

MESSAGES = [{"role": "user", "content": "Hi"}]


def post(served, path: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(served.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def chat_body(**fields):
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **fields}


# (case, path, body, param, code)
BAD_INPUTS = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": "tiny", "messages": [', None, "invalid_json"),
    ("not an object", "/v1/chat/completions", b"[1, 2]", None, "invalid_json"),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, "messages", "missing_required_parameter"),
    ("missing model", "/v1/chat/completions", {"messages": MESSAGES}, "model", "missing_required_parameter"),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, "prompt", "missing_required_parameter"),
    ("empty messages", "/v1/chat/completions", chat_body(messages=[]), "messages", "invalid_value"),
    ("mistyped max_tokens", "/v1/chat/completions", chat_body(max_tokens="5"), "max_tokens", "invalid_type"),
    ("float max_tokens", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2.5}, "max_tokens", "invalid_type"),
    ("mistyped stream", "/v1/chat/completions", chat_body(stream="yes"), "stream", "invalid_type"),
    ("mistyped content", "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": 5}]),
     "messages.[0].content", "invalid_type"),
    ("unknown role", "/v1/chat/completions", chat_body(messages=[{"role": "wizard", "content": "x"}]),
     "messages.[0].role", "invalid_type"),
    ("mistyped prompt", "/v1/completions", {"model": "tiny", "prompt": 5}, "prompt", "invalid_type"),
    ("unknown model", "/v1/chat/completions", chat_body(model="gpt-4"), "model", "model_not_found"),
    ("max_tokens beyond context", "/v1/chat/completions", chat_body(max_tokens=100000), "max_tokens",
     "context_length_exceeded"),
    ("max_completion_tokens beyond context", "/v1/chat/completions",
     chat_body(max_tokens=None, max_completion_tokens=100000), "max_completion_tokens", "context_length_exceeded"),
    ("prompt beyond context", "/v1/chat/completions",
     chat_body(messages=[{"role": "user", "content": "word " * 400}]), "messages", "context_length_exceeded"),
    ("completion prompt beyond context", "/v1/completions",
     {"model": "tiny", "prompt": list(range(5, 400)), "max_tokens": 1}, "prompt", "context_length_exceeded"),
    ("empty prompt", "/v1/completions", {"model": "tiny", "prompt": []}, "prompt", "invalid_value"),
    ("token id out of range", "/v1/completions", {"model": "tiny", "prompt": [10**7]}, "prompt", "invalid_value"),
    ("n beyond --max-n", "/v1/chat/completions", chat_body(n=17), "n", "invalid_value"),
    ("n zero", "/v1/chat/completions", chat_body(n=0), "n", "invalid_value"),
    ("best_of", "/v1/completions", {"model": "tiny", "prompt": "a", "best_of": 3}, "best_of", "unsupported_parameter"),
    ("prompts beyond --max-prompts", "/v1/completions", {"model": "tiny", "prompt": ["a"] * 65}, "prompt",
     "invalid_value"),
    ("one of several prompts empty", "/v1/completions", {"model": "tiny", "prompt": [[5, 6], []]}, "prompt",
     "invalid_value"),
    ("top_logprobs above 20", "/v1/chat/completions", chat_body(logprobs=True, top_logprobs=21), "top_logprobs",
     "invalid_value"),
    ("top_logprobs negative", "/v1/chat/completions", chat_body(logprobs=True, top_logprobs=-1), "top_logprobs",
     "invalid_value"),
    ("top_logprobs without logprobs", "/v1/chat/completions", chat_body(top_logprobs=2), "top_logprobs",
     "invalid_value"),
    ("completions logprobs above 5", "/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 6}, "logprobs",
     "invalid_value"),
    ("penalty beyond 2", "/v1/chat/completions", chat_body(presence_penalty=2.5), "presence_penalty", "invalid_value"),
    ("repetition_penalty zero", "/v1/chat/completions", chat_body(repetition_penalty=0), "repetition_penalty",
     "invalid_value"),
    ("logit_bias key not a token id", "/v1/chat/completions", chat_body(logit_bias={"abc": 1}), "logit_bias.abc",
     "invalid_value"),
    ("logit_bias token beyond the vocabulary", "/v1/chat/completions", chat_body(logit_bias={"5": 1, "9999999": 1}),
     "logit_bias.9999999", "invalid_value"),
    ("logit_bias value beyond 100", "/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"5": 150}},
     "logit_bias.5", "invalid_value"),
    ("temperature too high", "/v1/chat/completions", chat_body(temperature=2.5), "temperature", "invalid_value"),
    ("temperature negative", "/v1/completions", {"model": "tiny", "prompt": "a", "temperature": -0.1}, "temperature", "invalid_value"),
    ("top_p zero", "/v1/chat/completions", chat_body(top_p=0), "top_p", "invalid_value"),
    ("top_p above one", "/v1/chat/completions", chat_body(top_p=1.5), "top_p", "invalid_value"),
    ("max_tokens zero", "/v1/chat/completions", chat_body(max_tokens=0), "max_tokens", "invalid_value"),
    ("empty stop", "/v1/chat/completions", chat_body(stop=""), "stop", "unsupported_parameter"),
    ("seed beyond 64 bits", "/v1/chat/completions", chat_body(seed=2**70, temperature=1), "seed", "invalid_value"),
    ("negative seed", "/v1/completions", {"model": "tiny", "prompt": "a", "seed": -1}, "seed", "invalid_value"),
]


@pytest.mark.parametrize("case, path, body, param, code", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_400_naming_the_field(tiny_server, case, path, body, param, code):
    response = post(tiny_server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert error["code"] == code


def test_the_openai_client_sees_a_bad_request_error(tiny_server):
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_server.client().chat.completions.create(model="tiny", messages=MESSAGES, n=100)
    assert caught.value.status_code == 400 and caught.value.body["param"] == "n"


def test_oversized_body_is_413_and_unknown_route_is_404(tiny_target):
    served = start_server(tiny_target, max_body_bytes=4096)
    try:
        response = post(served, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "x" * 5000}]))
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        missing = httpx.get(served.url + "/v1/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        assert post(served, "/v1/chat/completions", chat_body()).status_code == 200
    finally:
        served.server.stop()


def test_a_full_queue_is_503_with_retry_after(tiny_target):
    served = start_server(tiny_target, max_running=1, max_waiting=1)
    gate = threading.Event()
    run_step = served.engine.executor.run

    def held_step(plan):  # hold the engine inside its first step
        gate.wait(30)
        return run_step(plan)

    served.engine.executor.run = held_step
    try:
        results = {}
        first = threading.Thread(target=lambda: results.setdefault("a", post(served, "/v1/chat/completions", chat_body())))
        first.start()
        while served.engine.num_running == 0:  # admitted, its step held
            threading.Event().wait(0.01)
        second = threading.Thread(target=lambda: results.setdefault("b", post(served, "/v1/chat/completions", chat_body())))
        second.start()
        while served.engine.num_waiting == 0:
            threading.Event().wait(0.01)
        refused = post(served, "/v1/chat/completions", chat_body())
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        rejected = served.metrics.rejected.labels(model_name="tiny", engine="0", reason="queue_full")
        assert rejected._value.get() == 1
        assert 'eyas:requests_rejected_total{engine="0",model_name="tiny",reason="queue_full"} 1.0' in \
            httpx.get(served.url + "/metrics").text
        gate.set()
        first.join(30)
        second.join(30)
        assert results["a"].status_code == results["b"].status_code == 200
    finally:
        gate.set()
        served.server.stop()


def test_api_key_is_required_on_v1_routes(tiny_target):
    served = start_server(tiny_target, api_key="sesame")
    try:
        assert post(served, "/v1/chat/completions", chat_body()).status_code == 401
        wrong = post(served, "/v1/chat/completions", chat_body(), {"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(served.url + "/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            served.client(api_key="nope").models.list()
        assert served.client(api_key="sesame").chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=3).choices[0].finish_reason == "length"
        assert httpx.get(served.url + "/health").status_code == 200  # probes need no key
    finally:
        served.server.stop()


def test_the_server_keeps_serving_after_bad_requests(tiny_server):
    for _, path, body, _, _ in BAD_INPUTS[:6]:
        post(tiny_server, path, body)
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok"}
    good = post(tiny_server, "/v1/chat/completions", chat_body())
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
