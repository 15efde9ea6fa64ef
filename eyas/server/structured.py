"""Structured outputs of a request: `response_format` (OpenAI) and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, turned into a grammar (eyas.engine.grammar) whose mask the
engine applies at every position, draft-tree nodes included.

Usage:
    spec = grammar_request(parsed)          # GrammarSpec or None; APIError 400 when malformed
    grammar = compile_for(spec, target)     # GrammarError for a schema llguidance refuses

`response_format` takes `{"type": "text"}`, `{"type": "json_object"}` (any JSON object) and
`{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`; the
schema is followed whether `strict` is true or not (as vLLM does). At most one of
`response_format` (other than text) and the guided fields may be given.
"""

from __future__ import annotations

import json
import re
from typing import Any

from eyas.engine.grammar import Grammar, GrammarSpec, compile_grammar
from eyas.engine.target import Target
from eyas.server.errors import APIError

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for schema and tool names


def invalid(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def response_format_spec(response_format: dict[str, Any] | None) -> GrammarSpec | None:
    """The grammar a `response_format` asks for (None for text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise invalid(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                      f"got {kind!r}", "response_format.type")
    described = response_format.get("json_schema")
    if not isinstance(described, dict):
        raise APIError(400, "response_format of type json_schema needs a 'json_schema' object "
                            "with 'name' and 'schema'", param="response_format.json_schema",
                       code="missing_required_parameter")
    name = described.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise invalid("response_format.json_schema.name must be 1-64 letters, digits, _ or -",
                      "response_format.json_schema.name")
    if "strict" in described and not isinstance(described["strict"], (bool, type(None))):
        raise invalid("response_format.json_schema.strict must be a boolean",
                      "response_format.json_schema.strict")
    schema = described.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid("response_format.json_schema.schema must be a JSON object (a JSON Schema)",
                      "response_format.json_schema.schema")
    return GrammarSpec("json_schema", schema)


def grammar_request(parsed: Any) -> tuple[GrammarSpec, str] | None:
    """(spec, the field it came from) for a request's structured output, if it asks for one."""
    found: list[tuple[GrammarSpec, str]] = []
    spec = response_format_spec(parsed.response_format)
    if spec is not None:
        param = "response_format.json_schema.schema" if spec.kind == "json_schema" else "response_format"
        found.append((spec, param))
    if parsed.guided_json is not None:
        value = parsed.guided_json
        if isinstance(value, str):  # vLLM takes the schema as a JSON string too
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid("guided_json must be a JSON Schema (an object or its JSON text)",
                              "guided_json") from None
        if not isinstance(value, dict):
            raise invalid("guided_json must be a JSON Schema object", "guided_json")
        found.append((GrammarSpec("json_schema", value), "guided_json"))
    if parsed.guided_regex is not None:
        found.append((GrammarSpec("regex", parsed.guided_regex), "guided_regex"))
    if parsed.guided_choice is not None:
        found.append((GrammarSpec("choice", parsed.guided_choice), "guided_choice"))
    if len(found) > 1:
        raise invalid("give at most one of response_format (json), guided_json, guided_regex "
                      "and guided_choice", found[1][1])
    return found[0] if found else None


def compile_for(spec: GrammarSpec, target: Target) -> Grammar:
    """The grammar for the served model's tokenizer (raises GrammarError)."""
    return compile_grammar(spec, target.tokenizer, target.config.vocab_size,
                           sorted(target.eos_token_ids))
