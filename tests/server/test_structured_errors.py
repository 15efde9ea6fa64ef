"""Structured outputs and tools refuse bad input with a 400 naming the field: invalid schemas,
unknown tool names, bad tool_choice."""

from __future__ import annotations

import json

import httpx
import pytest

MESSAGES = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def chat_body(**fields):
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **fields}


def schema_format(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# (case, path, body, param, code)
BAD_INPUTS = [
    ("invalid schema type", "/v1/chat/completions", chat_body(response_format=schema_format({"type": "objectx"})),
     "response_format.json_schema.schema", "invalid_value"),
    ("dangling $ref", "/v1/chat/completions",
     chat_body(response_format=schema_format({"properties": {"a": {"$ref": "#/$defs/missing"}}})),
     "response_format.json_schema.schema", "invalid_value"),
    ("schema not an object", "/v1/chat/completions", chat_body(response_format=schema_format([1, 2])),
     "response_format.json_schema.schema", "invalid_value"),
    ("json_schema missing", "/v1/chat/completions", chat_body(response_format={"type": "json_schema"}),
     "response_format.json_schema", "missing_required_parameter"),
    ("bad schema name", "/v1/chat/completions", chat_body(response_format=schema_format({}, name="a b")),
     "response_format.json_schema.name", "invalid_value"),
    ("unknown response_format", "/v1/chat/completions", chat_body(response_format={"type": "xml"}),
     "response_format.type", "invalid_value"),
    ("bad regex", "/v1/completions", {"model": "tiny", "prompt": "a", "guided_regex": "(("}, "guided_regex",
     "invalid_value"),
    ("empty choices", "/v1/completions", {"model": "tiny", "prompt": "a", "guided_choice": []}, "guided_choice",
     "invalid_value"),
    ("two grammars", "/v1/completions", {"model": "tiny", "prompt": "a", "guided_regex": "a+",
                                          "response_format": {"type": "json_object"}}, "guided_regex", "invalid_value"),
    ("unknown tool name", "/v1/chat/completions",
     chat_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "launch"}}),
     "tool_choice.function.name", "invalid_value"),
    ("bad tool_choice", "/v1/chat/completions", chat_body(tools=[WEATHER], tool_choice="always"),
     "tool_choice", "invalid_value"),
    ("tool_choice without tools", "/v1/chat/completions", chat_body(tool_choice="required"), "tool_choice",
     "invalid_value"),
    ("tool without function", "/v1/chat/completions", chat_body(tools=[{"type": "function"}]),
     "tools.[0].function", "missing_required_parameter"),
    ("invalid tool parameters schema", "/v1/chat/completions",
     chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
               tool_choice="required"), "tools", "invalid_value"),
    ("response_format with a required tool", "/v1/chat/completions",
     chat_body(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
     "response_format", "invalid_value"),
    ("functions", "/v1/chat/completions", chat_body(functions=[{"name": "f"}]), "functions",
     "unsupported_parameter"),
]


@pytest.mark.parametrize("case, path, body, param, code", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_structured_input_is_a_400_naming_the_field(tiny_server, case, path, body, param, code):
    response = httpx.post(tiny_server.url + path, content=json.dumps(body).encode(), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code)
