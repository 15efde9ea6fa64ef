"""Structured outputs: the schema-following check, and what the grammar mask costs per token,
plain and with speculation.

Usage:
    python -m eyas.bench.structured --model smollm2-135m --dtype float32 --threads 1 \\
        --drafts none ngram eagle3:smollm2-135m --max-tokens 160 --json runs/structured.json

For each drafting method (one engine each, `--speculation` as given, greedy), every prompt of
SCHEMAS is answered twice, one request at a time: without a grammar, and under its JSON schema
(the mask applied at every position, draft-tree nodes included, and drafts the grammar forbids
pruned). Reported per method and mode: output tokens/s, the grammar's own time per output token
(masks and draft checks, measured inside the constraint), the share of answers that parse as
JSON and follow their schema (checked by a validator independent of the grammar library), and
whether every schema answer equals the one of the first method (normally `none`: speculative
output under a schema must equal plain output under it).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

from eyas.engine.grammar import GrammarSpec, compile_grammar
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import PRECISIONS, Target
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.engine import Engine

NAME = {"type": "string", "maxLength": 40}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("Describe a fictional person as JSON.",
     {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                       "email": NAME}, "required": ["name", "age", "email"],
      "additionalProperties": False}),
    ("Give a product for an online shop as JSON.",
     {"type": "object", "properties": {"title": NAME, "price": {"type": "number"}, "in_stock": {"type": "boolean"},
                                       "tags": {"type": "array", "items": NAME, "maxItems": 4}},
      "required": ["title", "price", "in_stock", "tags"], "additionalProperties": False}),
    ("What is the capital of France? Answer in JSON.",
     {"type": "object", "properties": {"country": NAME, "capital": NAME}, "required": ["country", "capital"],
      "additionalProperties": False}),
    ("Classify the sentiment of: 'I love this phone, the battery lasts forever.'",
     {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["sentiment", "confidence"], "additionalProperties": False}),
    ("List three primary colors as JSON.",
     {"type": "object", "properties": {"colors": {"type": "array", "items": NAME, "minItems": 3, "maxItems": 3}},
      "required": ["colors"], "additionalProperties": False}),
    ("Give the address of a fictional company as JSON.",
     {"type": "object", "properties": {
         "company": NAME, "address": {"type": "object", "properties": {
             "street": NAME, "city": NAME, "zip": {"type": "string", "maxLength": 10}},
             "required": ["street", "city", "zip"], "additionalProperties": False}},
      "required": ["company", "address"], "additionalProperties": False}),
    ("Write a to-do list with two items as JSON.",
     {"type": "object", "properties": {"todos": {"type": "array", "maxItems": 3, "items": {
         "type": "object", "properties": {"task": NAME, "done": {"type": "boolean"}},
         "required": ["task", "done"], "additionalProperties": False}}},
      "required": ["todos"], "additionalProperties": False}),
    ("Is 17 a prime number? Answer as JSON.",
     {"type": "object", "properties": {"number": {"type": "integer"}, "is_prime": {"type": "boolean"}},
      "required": ["number", "is_prime"], "additionalProperties": False}),
    ("Describe the weather in Paris today as JSON.",
     {"type": "object", "properties": {"city": NAME, "temperature_c": {"type": "number"},
                                       "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
      "required": ["city", "temperature_c", "conditions"], "additionalProperties": False}),
    ("Recommend a book as JSON.",
     {"type": "object", "properties": {"title": NAME, "author": NAME,
                                       "year": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
      "required": ["title", "author", "year"], "additionalProperties": False}),
]

TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def follows(value: Any, schema: dict[str, Any]) -> bool:
    """Whether a JSON value follows `schema` (the keywords SCHEMAS uses; independent of the
    grammar library that produced it)."""
    if "anyOf" in schema:
        return any(follows(value, option) for option in schema["anyOf"])
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "integer" and not (isinstance(value, int) and not isinstance(value, bool)):
        return False
    if kind == "number" and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return False
    if kind in TYPES and not isinstance(value, TYPES[kind]) or (kind in ("object", "array", "string")
                                                                and isinstance(value, bool)):
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            return False
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        return False
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        return all(follows(item, schema.get("items", {})) for item in value)
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        if any(key not in value for key in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and any(key not in properties for key in value):
            return False
        return all(follows(item, properties.get(key, {})) for key, item in value.items())
    return True


def answer_all(engine: Engine, prompts: list[list[int]], params: SamplingParams,
               grammars: list[Any] | None) -> dict[str, Any]:
    """Answer the prompts one at a time (the engine's loop on this thread, as in `eyas serve`)."""
    texts: list[str] = ["" for _ in prompts]
    tokens = [0]
    constraints = []
    done = threading.Event()

    def client() -> None:
        for index, prompt in enumerate(prompts):
            finished = threading.Event()

            def on_output(output, index=index, finished=finished) -> None:
                texts[index] += output.text
                if output.finished:
                    tokens[0] += output.completion_tokens
                    finished.set()
            extra = {}
            if grammars is not None:
                constraints.append(grammars[index].constraint())
                extra = {"logits_processors": [constraints[-1]]}
            engine.submit(prompt, params, on_output, **extra)
            finished.wait()
        done.set()

    started = time.perf_counter()
    load = threading.Thread(target=client, name="structured-client")
    load.start()
    engine.run(stop_when=done.is_set)
    load.join()
    seconds = time.perf_counter() - started
    mask_seconds = sum(c.seconds for c in constraints)
    return {"texts": texts, "tokens": tokens[0], "seconds": seconds, "tokens_per_s": tokens[0] / seconds,
            "mask_ms_per_token": 1e3 * mask_seconds / max(tokens[0], 1) if grammars is not None else 0.0}


def chat_prompts(target: Target) -> list[list[int]]:
    from eyas.models.tokenizer import chat_prompt_ids

    return [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": question}])
            for question, _ in SCHEMAS]


def valid_rate(texts: list[str]) -> float:
    good = 0
    for text, (_, schema) in zip(texts, SCHEMAS):
        try:
            good += follows(json.loads(text), schema)
        except ValueError:
            pass
    return good / len(texts)


def replay_mask_ms(target: Target, grammars: list[Any], texts: list[str]) -> float:
    """Median over answers of the mask's milliseconds per token, replayed alone: each answer's
    positions masked in order by a fresh constraint (matcher advance, mask, bias add)."""
    import statistics

    import torch

    per_token = []
    for grammar, text in zip(grammars, texts):
        ids = list(target.tokenizer(text, add_special_tokens=False)["input_ids"])
        constraint, logits = grammar.constraint(), torch.zeros(target.config.vocab_size)
        started = time.perf_counter()
        for position in range(len(ids) + 1):
            constraint(ids[:position], logits.clone())
        per_token.append(1e3 * (time.perf_counter() - started) / (len(ids) + 1))
    return statistics.median(per_token)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", choices=PRECISIONS)
    parser.add_argument("--drafts", nargs="+", default=["none", "ngram"])
    parser.add_argument("--speculation", default="always", choices=["auto", "always", "never"])
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 for per-token costs)")
    parser.add_argument("--no-free", action="store_true", help="skip the answers without a grammar")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    import torch

    from eyas.engine.target import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=args.dtype)
    prompts = chat_prompts(target)
    grammars = [compile_grammar(GrammarSpec("json_schema", schema), target.tokenizer,
                                target.config.vocab_size, sorted(target.eos_token_ids))
                for _, schema in SCHEMAS]
    params = SamplingParams(max_tokens=args.max_tokens)
    print(f"model {args.model} ({target.precision}), {len(SCHEMAS)} schemas, {args.max_tokens} new "
          f"tokens at most, greedy, torch threads {torch.get_num_threads()}")
    results, reference = [], None
    for draft in args.drafts:
        engine = Engine(target, EngineConfig(max_running=1, speculation=args.speculation,
                                             num_draft_tokens=args.num_draft_tokens), draft=draft)
        answer_all(engine, prompts[:1], SamplingParams(max_tokens=8), None)  # warm-up
        free = None if args.no_free else answer_all(engine, prompts, params, None)
        constrained = answer_all(engine, prompts, params, grammars)
        engine.shutdown()
        reference = reference or constrained["texts"]
        row = {"draft": draft, "speculation": args.speculation,
               "free_tokens_per_s": round(free["tokens_per_s"], 2) if free else None,
               "schema_tokens_per_s": round(constrained["tokens_per_s"], 2),
               "schema_tokens": constrained["tokens"],
               "mask_ms_per_token": round(constrained["mask_ms_per_token"], 3),
               "valid_json_rate": valid_rate(constrained["texts"]),
               "free_valid_json_rate": valid_rate(free["texts"]) if free else None,
               "schema_outputs_equal_first": constrained["texts"] == reference}
        results.append(row)
        print(json.dumps(row))
    replayed = replay_mask_ms(target, grammars, reference)
    print(json.dumps({"mask_ms_per_token_replayed": round(replayed, 3)}))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results, "mask_ms_per_token_replayed": replayed,
                       "outputs": reference}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
