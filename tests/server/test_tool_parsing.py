"""Tools without a model: tool_choice checks, the fallback rendering, parsing of tool calls
and their streamed deltas in OpenAI's shape."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from eyas.server.errors import APIError
from eyas.server.protocol import ChatCompletionRequest
from eyas.server.tools import ToolStream, fallback_messages, render, supports_tools, template_messages, tool_plan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def request(**fields):
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_tool_choice_forms():
    assert tool_plan(request()) is None
    assert tool_plan(request(tools=[WEATHER])).choice == "auto"
    assert tool_plan(request(tools=[WEATHER], tool_choice="required")).choice == "required"
    named = tool_plan(request(tools=[WEATHER, TIME],
                              tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert (named.choice, named.named) == ("function", "get_time")
    assert named.grammar().value == {"type": "object"}


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools.[0].type"),
    ({"tools": [{"type": "function"}]}, "tools.[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools.[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools.[0].function.parameters"),
])
def test_bad_tools_are_a_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as caught:
        tool_plan(request(**fields))
    assert caught.value.status == 400 and caught.value.param == param


def test_auto_parses_hermes_blocks_and_keeps_the_rest_as_content():
    plan = tool_plan(request(tools=[WEATHER, TIME]))
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = plan.parse(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert plan.finish_reason("stop", calls) == "tool_calls"
    # unknown names and broken JSON stay text
    assert plan.parse('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')[1] == []
    assert plan.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])


def test_required_and_named_parse_the_constrained_output():
    required = tool_plan(request(tools=[WEATHER, TIME], tool_choice="required"))
    schema = required.grammar().value
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    content, calls = required.parse('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    named = tool_plan(request(tools=[WEATHER], tool_choice={"type": "function",
                                                             "function": {"name": "get_weather"}}))
    content, calls = named.parse('{"city": "Rome"}')
    assert content is None and calls[0]["function"]["arguments"] == '{"city": "Rome"}'
    assert named.finish_reason("stop", calls) == "stop"
    single = tool_plan(request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert single.grammar().value["maxItems"] == 1


def test_streamed_deltas_hold_back_a_possible_tool_call_and_emit_it_whole():
    plan = tool_plan(request(tools=[WEATHER]))
    stream = ToolStream(plan)
    pieces = ["Sure", ". <tool", "_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Oslo\"}}",
              "\n</tool_call>"]
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.flush()
    assert deltas[0] == {"content": "Sure"} and deltas[1] == {"content": ". "}
    call = deltas[-1]["tool_calls"][0]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert len(deltas) == 3
    # a '<' that does not start a tool call is content after all
    plain = ToolStream(plan)
    assert plain.feed("a <") == [{"content": "a "}] and plain.feed("b") == [{"content": "<b"}]


def test_named_streams_the_arguments_as_they_come():
    plan = tool_plan(request(tools=[WEATHER], tool_choice={"type": "function",
                                                            "function": {"name": "get_weather"}}))
    stream = ToolStream(plan)
    first = stream.feed('{"city"')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}
    assert stream.feed(': "Rome"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": ': "Rome"}'}}]}]
    assert stream.flush() == []


def test_fallback_puts_tools_in_the_system_message_and_history_in_hermes_form(smollm_tokenizer):
    assert not supports_tools(smollm_tokenizer)
    parsed = request(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}])
    plan = tool_plan(parsed)
    messages = fallback_messages(template_messages(parsed), plan)
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call the functions below.")
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    text = smollm_tokenizer.decode(render(smollm_tokenizer, template_messages(parsed), plan))
    assert "<tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_a_template_with_tools_gets_them_through_apply_chat_template(smollm_tokenizer):
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }} "
                "{{ c.function.arguments.city }}]{% endfor %}{% endif %}\n{% endfor %}A:")
    tokenizer = SimpleNamespace(chat_template=template)
    assert supports_tools(tokenizer)
    parsed = request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}])
    original = smollm_tokenizer.chat_template
    try:
        smollm_tokenizer.chat_template = template
        text = smollm_tokenizer.decode(render(smollm_tokenizer, template_messages(parsed), tool_plan(parsed)))
    finally:
        smollm_tokenizer.chat_template = original
    assert text == "TOOLS:get_weather;user: Oslo?assistant: [get_weather Oslo]A:"  # (trim_blocks)
