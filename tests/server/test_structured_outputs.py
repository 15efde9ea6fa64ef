"""Structured outputs and tools through the official openai client, streamed and not: the
answers follow their schema, and speculative output under a schema equals plain output under
it (tiny model with n-gram drafts against no drafts; SmolLM2 with n-grams and the shipped
EAGLE-3 head in the slow test)."""

from __future__ import annotations

import json

import pytest

from server_support import start_server

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "count"], "additionalProperties": False}
CITY = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def ask(client, name, stream=False, **fields):
    request = {"model": name, "temperature": 0, "max_tokens": 24,
               "messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."}], **fields}
    if not stream:
        return client.chat.completions.create(**request)
    return list(client.chat.completions.create(stream=True, **request))


def streamed_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def streamed_calls(chunks) -> list[dict]:
    """Tool-call deltas accumulated as OpenAI's clients do (by index)."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
            call["id"] = call["id"] or delta.id
            if delta.function.name:
                call["name"] += delta.function.name
            call["arguments"] += delta.function.arguments or ""
    return [calls[index] for index in sorted(calls)]


@pytest.fixture(params=["ngram", "none"])
def served(request, tiny_server, tiny_plain_server):
    return tiny_server if request.param == "ngram" else tiny_plain_server


def test_json_schema_answers_follow_it_and_drafts_change_nothing(tiny_server, tiny_plain_server):
    answers = []
    for served in (tiny_server, tiny_plain_server):
        client = served.client()
        response = ask(client, served.name, response_format=schema_format(ANSWER))
        chunks = ask(client, served.name, stream=True, response_format=schema_format(ANSWER))
        assert streamed_text(chunks) == response.choices[0].message.content
        answers.append(response.choices[0].message.content)
    assert answers[0] == answers[1]  # n-gram drafts against none, under the same schema
    value = json.loads(answers[0])
    assert value["answer"] in ("yes", "no", "maybe") and 0 <= value["count"] <= 9
    assert set(value) == {"answer", "count"}


def test_completions_take_guided_choice_and_response_format(served):
    client = served.client()
    response = client.completions.create(model=served.name, prompt="The sky is", max_tokens=8, temperature=0,
                                         extra_body={"guided_choice": ["blue", "green"]})
    assert response.choices[0].text in ("blue", "green") and response.choices[0].finish_reason == "stop"
    response = client.completions.create(model=served.name, prompt="JSON:", max_tokens=24, temperature=0,
                                         extra_body={"response_format": schema_format(ANSWER)})
    assert json.loads(response.choices[0].text)["answer"] in ("yes", "no", "maybe")


def test_json_object_is_an_object_or_a_prefix_of_one(served):
    response = ask(served.client(), served.name, response_format={"type": "json_object"}, max_tokens=12)
    text = response.choices[0].message.content
    assert text.startswith("{")
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_named_tool_call_streamed_and_not(served):
    client = served.client()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = ask(client, served.name, tools=[CITY, CLOCK], tool_choice=choice)
    message = response.choices[0].message
    assert message.content is None and response.choices[0].finish_reason == "stop"
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Paris", "Rome")
    chunks = ask(client, served.name, stream=True, tools=[CITY, CLOCK], tool_choice=choice)
    [streamed] = streamed_calls(chunks)
    assert (streamed["name"], streamed["arguments"]) == ("get_weather", call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_required_tool_call_streamed_and_not(served):
    client = served.client()
    response = ask(client, served.name, tools=[CITY, CLOCK], tool_choice="required", max_tokens=40)
    chunks = ask(client, served.name, stream=True, tools=[CITY, CLOCK], tool_choice="required", max_tokens=40)
    finish = response.choices[0].finish_reason
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    if finish == "length":  # the tiny model's array did not close within max_tokens
        assert response.choices[0].message.content.startswith("[{")
        return
    assert finish == "tool_calls"
    calls = response.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    assert [(c["name"], c["arguments"]) for c in streamed_calls(chunks)] == \
        [(c.function.name, c.function.arguments) for c in calls]


def test_tool_results_are_accepted_back(served):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C and snow"}]
    raw = served.client().chat.completions.with_raw_response.create(
        model=served.name, messages=messages, tools=[CITY], temperature=0, max_tokens=8)
    assert raw.headers.get("x-eyas-ignored-fields") is None  # tool_calls, tool_call_id: known
    response = raw.parse()
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert response.usage.prompt_tokens > 40  # the tools and the history were rendered


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["ngram", "eagle3:smollm2-135m"])
def test_smollm2_under_a_schema_speculative_equals_plain(smollm_target, draft):
    """Greedy SmolLM2 (float32) under JSON schemas and a required tool call: the same answers
    with drafts as without, and every finished answer follows its schema."""
    from eyas.bench.structured import SCHEMAS, follows

    outputs = {}
    for method in ("none", draft):
        served = start_server(smollm_target, "smollm2", draft=method, max_running=4)
        try:
            client = served.client()
            texts = []
            for question, schema in SCHEMAS[:5]:
                reply = client.chat.completions.create(
                    model="smollm2", temperature=0, max_tokens=96, response_format=schema_format(schema),
                    messages=[{"role": "user", "content": question}])
                texts.append(reply.choices[0].message.content)
                assert follows(json.loads(texts[-1]), schema), texts[-1]
            reply = client.chat.completions.create(
                model="smollm2", temperature=0, max_tokens=64, tools=[CITY, CLOCK], tool_choice="required",
                messages=[{"role": "user", "content": "What is the weather in Paris?"}])
            texts.append([(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls])
            outputs[method] = texts
            if method != "none":
                assert served.engine.proposers.enabled
        finally:
            served.server.stop()
    assert outputs[draft] == outputs["none"]
