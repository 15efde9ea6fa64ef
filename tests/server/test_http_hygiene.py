"""HTTP hygiene: a body nested too deep, a method the route does not take, a body that is not
JSON, the OpenAPI document, fields the server ignores, integral floats for integers. Each
answer's status and JSON body are checked."""

from __future__ import annotations

import logging

import httpx
import pytest

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_a_deeply_nested_body_is_a_400_and_the_connection_stays_usable(tiny_plain_server):
    with httpx.Client(base_url=tiny_plain_server.url, timeout=60) as client:
        deep = client.post("/v1/chat/completions", content=b"[" * 200_000,
                           headers={"content-type": "application/json"})
        assert deep.status_code == 400
        error = deep.json()["error"]
        assert error["code"] == "invalid_json" and "200000 levels" in error["message"]
        within = client.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2,
                                                      "stop": [[[["x"]]]]})
        assert within.status_code == 400 and within.json()["error"]["param"] == "stop"
        # a string full of brackets is not nesting
        fine = client.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2,
                                                    "stop": ["[" * 500, "{\\\"[" * 100]})
        assert fine.status_code == 200, fine.text
        again = client.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2})
        assert again.status_code == 200  # the same client, after the refusal
        assert client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "a", "temperature": NaN}',
                           headers={"content-type": "application/json"}).json()["error"]["code"] == "invalid_json"


def test_a_wrong_method_is_a_405_with_allow(tiny_plain_server):
    response = httpx.get(tiny_plain_server.url + "/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert httpx.post(tiny_plain_server.url + "/health").headers["allow"] == "GET"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_json_is_a_415(tiny_plain_server, content_type):
    response = httpx.post(tiny_plain_server.url + "/v1/chat/completions", content=b'{"model": "tiny"}',
                          headers={"content-type": content_type})
    assert response.status_code == 415
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type" and content_type in error["message"]


def test_json_content_types_are_accepted(tiny_plain_server):
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        response = httpx.post(tiny_plain_server.url + "/v1/completions", headers={"content-type": content_type},
                              content=b'{"model": "tiny", "prompt": "a", "max_tokens": 1}')
        assert response.status_code == 200, (content_type, response.text)


def test_the_openapi_document_is_served_with_the_request_schemas(tiny_plain_server):
    document = httpx.get(tiny_plain_server.url + "/openapi.json").json()
    assert document["openapi"].startswith("3.") and document["info"]["title"] == "eyas"
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    schemas = document["components"]["schemas"]
    assert {"messages", "max_tokens", "seed"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert "ChatMessage" in schemas and "prompt" in schemas["CompletionRequest"]["properties"]
    assert {"/v1/models", "/health", "/metrics", "/v1/completions"} <= set(document["paths"])


def test_ignored_fields_are_named_in_a_header_and_a_log_line(tiny_plain_server, caplog):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi", "nickname": "ann"}], "max_tokens": 2,
            "frobnicate": True, "stream_options": None}
    with caplog.at_level(logging.WARNING, logger="eyas.server"):
        response = httpx.post(tiny_plain_server.url + "/v1/chat/completions", json=body, timeout=60)
        streamed = httpx.post(tiny_plain_server.url + "/v1/chat/completions", json={**body, "stream": True},
                              timeout=60)
    assert response.status_code == 200
    assert response.headers["x-eyas-ignored-fields"] == "messages.[0].nickname,frobnicate"
    assert streamed.headers["x-eyas-ignored-fields"] == "messages.[0].nickname,frobnicate"
    assert any("messages.[0].nickname, frobnicate" in record.getMessage() for record in caplog.records)
    clean = httpx.post(tiny_plain_server.url + "/v1/chat/completions",
                       json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}, timeout=60)
    assert "x-eyas-ignored-fields" not in clean.headers


def test_integral_floats_count_as_integers(tiny_plain_server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4.0, "n": 1.0, "seed": 5.0, "top_k": 3.0,
            "temperature": 1, "ignore_eos": True}
    response = httpx.post(tiny_plain_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    for field, value, code in (("max_tokens", 4.5, "invalid_type"), ("n", 2.5, "invalid_type"),
                               ("max_tokens", 0.0, "invalid_value")):
        refused = httpx.post(tiny_plain_server.url + "/v1/chat/completions", json={**body, field: value}, timeout=60)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == field and refused.json()["error"]["code"] == code
