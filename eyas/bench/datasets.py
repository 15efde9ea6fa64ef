"""Prompt sets for the serving benchmark: mtbench, sharegpt, random, repeated and jsonl:PATH.

Usage:
    prompts = load_bench_prompts("mtbench", num_prompts=32)
    prompts = load_bench_prompts("random", num_prompts=32, tokenizer=tok, input_len=256, seed=0)
    prompts = load_bench_prompts("jsonl:data/my_prompts.jsonl", num_prompts=100)

Sets:
- `mtbench`: MT-Bench first turns, one category after another (`eyas.bench.prompts`).
- `sharegpt`: the first user turn of each ShareGPT conversation, in file order, skipping empty
  turns and turns longer than `MAX_SHAREGPT_CHARS` (rare huge pastes that would dominate TTFT).
- `random`: `input_len` token ids drawn uniformly from the tokenizer's vocabulary (special tokens
  excluded) and decoded to text; the same seed gives the same prompts. The server re-tokenizes
  the text, so its input length is close to, not exactly, `input_len`.
- `repeated`: traffic that repeats itself (`eyas.bench.repeated`): MT-Bench questions asked
  again, code prompts asked twice, conversations re-sent with their history and one more turn
  (the history's answer is MT-Bench's reference answer); first asks, then second asks.
- `jsonl:PATH`: one record a line with a `"prompt"` string or OpenAI `"messages"`.

A set with fewer prompts than asked is repeated from its start.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from eyas.errors import EyasError

MAX_SHAREGPT_CHARS = 4096
DATASET_NAMES = ("mtbench", "sharegpt", "random", "jsonl:PATH", "repeated")


@dataclass(frozen=True)
class BenchPrompt:
    messages: tuple[dict[str, str], ...]  # what /v1/chat/completions is sent
    text: str | None  # what /v1/completions is sent; None for a multi-message record
    input_tokens: int | None = None  # known before sending (random prompts); else from usage

    @staticmethod
    def from_text(text: str, input_tokens: int | None = None) -> BenchPrompt:
        return BenchPrompt(({"role": "user", "content": text},), text, input_tokens)

    def counted_text(self) -> str:
        """The text to count with a tokenizer when the server reports no prompt tokens."""
        return self.text if self.text is not None else "\n".join(m["content"] for m in self.messages)


def check_dataset_spec(spec: str) -> None:
    """Raise EyasError unless `spec` names a prompt set (files are checked when loaded)."""
    if spec in ("mtbench", "sharegpt", "random", "repeated"):
        return
    if spec.startswith("jsonl:") and len(spec) > len("jsonl:"):
        return
    raise EyasError(f"unknown dataset '{spec}'; accepted: {', '.join(DATASET_NAMES)}")


def mtbench_prompts(limit: int) -> list[BenchPrompt]:
    from eyas.bench.prompts import mtbench_first_turns

    return [BenchPrompt.from_text(question) for question in mtbench_first_turns(limit)]


def sharegpt_prompts(limit: int) -> list[BenchPrompt]:
    from eyas.data.records import RecordError, conversation_from_dict
    from eyas.data.sources import RawRecord, read_raw_records, resolve_source

    prompts: list[BenchPrompt] = []
    for item in read_raw_records(resolve_source("sharegpt")):
        if not isinstance(item, RawRecord):
            continue  # a record cut off or broken in the file
        try:
            turns = conversation_from_dict(item.value, "sharegpt", f"sharegpt-{item.line}").user_turns
        except RecordError:
            continue
        if turns and turns[0].strip() and len(turns[0]) <= MAX_SHAREGPT_CHARS:
            prompts.append(BenchPrompt.from_text(turns[0]))
            if len(prompts) >= limit:
                break
    return prompts


def random_prompts(limit: int, tokenizer: Any, input_len: int, seed: int) -> list[BenchPrompt]:
    if tokenizer is None:
        raise EyasError("the random dataset needs a tokenizer: pass --tokenizer MODEL "
                        "(the target's, e.g. smollm2-135m), not 'none'")
    special = set(tokenizer.all_special_ids)
    vocabulary = [token for token in range(len(tokenizer)) if token not in special]
    rng = random.Random(seed)
    prompts = []
    for _ in range(limit):
        ids = rng.choices(vocabulary, k=input_len)
        prompts.append(BenchPrompt.from_text(tokenizer.decode(ids), input_tokens=input_len))
    return prompts


def jsonl_prompts(path: str, limit: int) -> list[BenchPrompt]:
    from eyas.data.records import RecordError, conversation_from_dict
    from eyas.data.sources import RawError, read_raw_records, resolve_source

    source = resolve_source(path)
    prompts: list[BenchPrompt] = []
    for item in read_raw_records(source):
        if isinstance(item, RawError):
            raise EyasError(f"{path}, line {item.line}: {item.reason}")
        record = item.value
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append(BenchPrompt.from_text(record["prompt"]))
        elif isinstance(record, dict) and "messages" in record:
            try:
                messages = conversation_from_dict(record, source.name, str(item.line)).messages
            except RecordError as error:
                raise EyasError(f"{path}, line {item.line}: {error}") from error
            if not messages:
                raise EyasError(f"{path}, line {item.line}: 'messages' is empty")
            dicts = tuple(message.to_dict() for message in messages)
            text = dicts[0]["content"] if len(dicts) == 1 and dicts[0]["role"] == "user" else None
            prompts.append(BenchPrompt(dicts, text))
        else:
            raise EyasError(f"{path}, line {item.line}: a record needs a \"prompt\" string or "
                            f"OpenAI \"messages\"")
        if len(prompts) >= limit:
            break
    return prompts


def repeated_bench_prompts(limit: int) -> list[BenchPrompt]:
    from eyas.bench.repeated import repeated_prompts

    return [BenchPrompt(messages, messages[0]["content"] if len(messages) == 1 else None)
            for messages in repeated_prompts(limit)[:limit]]


def load_bench_prompts(spec: str, num_prompts: int, tokenizer: Any = None, input_len: int = 128,
                       seed: int = 0) -> list[BenchPrompt]:
    """`num_prompts` prompts of the set `spec` (see the module docstring)."""
    check_dataset_spec(spec)
    if spec == "mtbench":
        prompts = mtbench_prompts(num_prompts)
    elif spec == "sharegpt":
        prompts = sharegpt_prompts(num_prompts)
    elif spec == "random":
        prompts = random_prompts(num_prompts, tokenizer, input_len, seed)
    elif spec == "repeated":
        prompts = repeated_bench_prompts(num_prompts)
    else:
        prompts = jsonl_prompts(spec[len("jsonl:"):], num_prompts)
    if not prompts:
        raise EyasError(f"dataset '{spec}' holds no usable prompt")
    if len(prompts) < num_prompts:
        print(f"[eyas] dataset '{spec}' has {len(prompts)} prompts; repeating them to reach "
              f"{num_prompts}")
        prompts = [prompts[i % len(prompts)] for i in range(num_prompts)]
    return prompts
