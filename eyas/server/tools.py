"""Tools (function calling) on /v1/chat/completions: definitions, `tool_choice`, rendering,
and tool calls parsed out of the model's text.

1. **Definitions**: `tools` is a list of `{"type": "function", "function": {"name",
   "description", "parameters"}}`; `tool_choice` is "none", "auto" (the default when tools are
   given), "required", or `{"type": "function", "function": {"name": ...}}` naming one of them.
2. **Rendering**: the target's chat template gets `tools=[...]` (transformers'
   `apply_chat_template`), assistant messages keep their `tool_calls` (arguments as objects, as
   templates expect) and `role: tool` messages their `tool_call_id`. A template that ignores
   `tools` (it renders the same text with and without them) gets the fallback instead: the
   definitions go into the system message with the instruction to answer with
   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes format many
   templates use), past tool calls are written in that format and tool results become user
   turns wrapped in `<tool_response>...</tool_response>`.
3. **Output**: "auto": `<tool_call>` blocks whose JSON names a given tool become
   `message.tool_calls` (the rest of the text stays the content; `finish_reason`
   "tool_calls"). "required" and a named function use the grammar path (as vLLM does): the
   output is constrained to a JSON array of `{"name", "parameters"}` calls of the given tools
   (required), or to the named function's parameters (named, `finish_reason` "stop" as OpenAI
   gives). "none": tools are rendered, nothing is parsed.

Usage:
    plan = tool_plan(parsed)                         # None without tools; APIError when malformed
    messages = template_messages(parsed, plan, tokenizer)
    prompt_ids = render(tokenizer, messages, plan)
    content, calls = plan.parse(text)                # non-streamed
    stream = ToolStream(plan); stream.feed(delta) ... stream.flush()   # streamed deltas
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from eyas.engine.grammar import GrammarSpec
from eyas.server.errors import APIError
from eyas.server.structured import NAME_PATTERN, invalid

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
FALLBACK_PROMPT = (
    "You can call the functions below. To call one, answer with a JSON object inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n</tool_call>\n\n"
    "Functions:\n{definitions}")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    functions: list[dict[str, Any]]  # each {"name", "description"?, "parameters"?}
    choice: str  # "none", "auto", "required", or "function" (named)
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: False allows one call at most
    names: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.names = {function["name"] for function in self.functions}

    @property
    def definitions(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": function} for function in self.functions]

    def grammar(self) -> GrammarSpec | None:
        """The schema the output must follow: required / named; None for auto and none."""
        if self.choice == "function":
            function = next(f for f in self.functions if f["name"] == self.named)
            return GrammarSpec("json_schema", function.get("parameters") or {"type": "object"})
        if self.choice != "required":
            return None
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": function["name"]},
                                 "parameters": function.get("parameters") or {"type": "object"}}}
                 for function in self.functions]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return GrammarSpec("json_schema", array)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished answer in OpenAI's shape."""
        if self.choice == "none":
            return text, []
        if self.choice == "function":
            return None, [tool_call(self.named, text)]
        if self.choice == "required":
            try:
                calls = json.loads(text)
                return None, [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                              for c in calls]
            except (ValueError, TypeError, KeyError):  # cut by max_tokens: not a whole array
                return text, []
        calls, kept, cursor = [], [], 0
        for match in CALL_BLOCK.finditer(text):
            parsed = self._call(match.group(1))
            if parsed is None:
                continue
            calls.append(parsed)
            kept.append(text[cursor : match.start()])
            cursor = match.end()
        if not calls:
            return text, []
        if not self.parallel:
            calls = calls[:1]
        content = "".join(kept + [text[cursor:]]).strip()
        return content or None, calls

    def _call(self, body: str) -> dict[str, Any] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            return tool_call(value["name"], arguments)
        return tool_call(value["name"], json.dumps(arguments, ensure_ascii=False))

    def finish_reason(self, reason: str | None, calls: list[dict[str, Any]]) -> str | None:
        if calls and reason == "stop" and self.choice != "function":
            return "tool_calls"
        return reason


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- the request -----------------------------------------------------------------------------
def tool_plan(parsed: Any) -> ToolPlan | None:
    """The request's tools and tool_choice, checked (400 naming the field when malformed)."""
    tools, choice = parsed.tools, parsed.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    functions = []
    for index, tool in enumerate(tools):
        param = f"tools.[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid("each tool must be {\"type\": \"function\", \"function\": {...}}", f"{param}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(400, "a tool needs a 'function' object", param=f"{param}.function",
                           code="missing_required_parameter")
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise invalid("a function name must be 1-64 letters, digits, _ or -", f"{param}.function.name")
        if any(f["name"] == name for f in functions):
            raise invalid(f"the function name '{name}' is given twice", f"{param}.function.name")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid("function parameters must be a JSON Schema object", f"{param}.function.parameters")
        functions.append({key: function[key] for key in ("name", "description", "parameters")
                          if function.get(key) is not None})
    parallel = parsed.parallel_tool_calls is not False
    if choice is None or choice in ("auto", "none", "required"):
        return ToolPlan(functions, choice or "auto", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {f["name"] for f in functions}:
            raise invalid(f"tool_choice names the function {name!r}, which is not among the tools "
                          f"({', '.join(f['name'] for f in functions)})", "tool_choice.function.name")
        return ToolPlan(functions, "function", name, parallel)
    raise invalid("tool_choice must be 'none', 'auto', 'required' or "
                  "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def template_messages(parsed: Any) -> list[dict[str, Any]]:
    """The request's messages as chat templates take them (tool calls with object arguments)."""
    messages = []
    for index, message in enumerate(parsed.messages):
        rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            rendered["tool_calls"] = [template_call(call, f"messages.[{index}].tool_calls.[{i}]")
                                      for i, call in enumerate(message.tool_calls)]
        if message.tool_call_id is not None:
            rendered["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            rendered["name"] = message.name
        messages.append(rendered)
    return messages


def template_call(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid("a tool call needs {\"function\": {\"name\", \"arguments\"}}", f"{param}.function")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # templates that print the string as it is still can
    return {"id": call.get("id") or call_id(), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders `tools` (it reads the variable)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return bool(template) and re.search(r"\btools\b", template) is not None


def render(tokenizer: Any, messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[int]:
    """Prompt ids: the template with tools, or the fallback when the template has no tools."""
    history_has_calls = any(m.get("tool_calls") for m in messages)
    if supports_tools(tokenizer):
        tools = plan.definitions if plan is not None else None
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    else:
        if plan is not None or history_has_calls:
            messages = fallback_messages(messages, plan)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def fallback_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """For a template without tool support: definitions in the system message, calls and
    results as text (module docstring)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content") or ""
        if message["role"] == "assistant" and message.get("tool_calls"):
            blocks = [f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                      "arguments": c["function"]["arguments"]},
                                                     ensure_ascii=False) + f"\n{CALL_CLOSE}"
                      for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": message["role"], "content": content})
    if plan is not None and plan.choice != "none":
        definitions = "\n".join(json.dumps(d, ensure_ascii=False) for d in plan.definitions)
        prompt = FALLBACK_PROMPT.format(definitions=definitions)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}".strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---- streaming -------------------------------------------------------------------------------
class ToolStream:
    """Text deltas -> chat deltas in OpenAI's shape. Named function: the arguments stream as
    they come (the first delta carries the id and name). Auto: content streams until a
    `<tool_call>` may start (a possible prefix of it is held back); from there the text is
    kept and parsed at the end. Required: the whole answer is parsed at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""  # text not yet sent as content
        self.calls: list[dict[str, Any]] = []
        self.started = False  # named: the first delta went out

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.plan.choice == "none":
            return [{"content": text}]
        if self.plan.choice == "function":
            deltas = []
            if not self.started:
                self.started = True
                call = tool_call(self.plan.named, "")
                self.calls.append(call)
                deltas.append({"tool_calls": [{"index": 0, **call}]})
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        self.held += text
        if self.plan.choice == "required" or CALL_OPEN in self.held:
            return []
        keep = next((n for n in range(len(CALL_OPEN) - 1, 0, -1) if self.held.endswith(CALL_OPEN[:n])), 0)
        content, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return [{"content": content}] if content else []

    def flush(self) -> list[dict[str, Any]]:
        """The deltas left once the answer is finished."""
        if self.plan.choice in ("none", "function") or not self.held:
            return []
        content, calls = self.plan.parse(self.held)
        self.held = ""
        self.calls = calls
        deltas = [{"content": content}] if content else []
        deltas += [{"tool_calls": [{"index": index, **call}]} for index, call in enumerate(calls)]
        return deltas
