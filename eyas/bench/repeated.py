"""The `repeated` prompt set: traffic that repeats itself, as agents, code assistants and
users who regenerate answers send it. Built from the packaged sets (MT-Bench and the code set):

- regenerate: an MT-Bench first turn asked a second time;
- code twice: each code prompt asked a second time;
- agentic: an MT-Bench conversation re-sent with its history, [q1] and then [q1, a1, q2],
  where a1 is the answer to q1: from `answer` (the offline benchmark passes the target's own
  greedy answer, what a client would have received) or else MT-Bench's reference answer
  (conversations without one are left out).

Every item is asked twice: the first asks of all items come first, then the second asks in
the same order, so that a server has finished the first ask before the second arrives.

Usage:
    prompts = repeated_prompts(16)                          # 8 items, each asked twice
    prompts = repeated_prompts(16, answer=my_greedy_answer)  # answer(messages) -> text
"""

from __future__ import annotations

import json
from typing import Callable

Messages = tuple[dict[str, str], ...]
KINDS = ("regenerate", "code", "agentic")


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _reference_answers() -> dict[int, str]:
    """MT-Bench's reference answers to first turns, by question id (where there is one)."""
    from eyas.bench.prompts import MTBENCH_FILE, MTBENCH_PACKAGE
    from eyas.models.registry import package_dir

    folder = package_dir(MTBENCH_PACKAGE)
    path = folder / MTBENCH_FILE.replace("question.jsonl", "reference_answer/gpt-4.jsonl") if folder else None
    if path is None or not path.is_file():
        return {}
    answers = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            answers[record["question_id"]] = record["choices"][0]["turns"][0]
    return answers


def repeated_items(count: int, answer: Callable[[Messages], str] | None = None) -> list[list[Messages]]:
    """`count` items, each the list of requests (message tuples) to send, in order: a
    regenerated question and a code prompt are [m, m]; an agentic one [[q1], [q1, a1, q2]]."""
    from eyas.bench.prompts import CODE_PROMPTS, mtbench_questions

    questions = mtbench_questions()
    references = {} if answer is not None else _reference_answers()
    conversations = [q for q in questions if len(q["turns"]) > 1
                     and (answer is not None or q["question_id"] in references)]
    singles = [q["turns"][0] for q in questions]
    makers = {
        "regenerate": lambda i: [(_user(singles[i % len(singles)]),)] * 2,
        "code": lambda i: [(_user(CODE_PROMPTS[i % len(CODE_PROMPTS)]),)] * 2,
        "agentic": lambda i: _agentic(conversations[i % len(conversations)], answer, references),
    }
    kinds = [k for k in KINDS if k != "agentic" or conversations]
    return [makers[kinds[i % len(kinds)]](i // len(kinds)) for i in range(count)]


def _agentic(question: dict, answer, references: dict[int, str]) -> list[Messages]:
    first = (_user(question["turns"][0]),)
    reply = answer(first) if answer is not None else references[question["question_id"]]
    return [first, first + ({"role": "assistant", "content": reply}, _user(question["turns"][1]))]


def repeated_prompts(num_prompts: int, answer: Callable[[Messages], str] | None = None) -> list[Messages]:
    """`num_prompts` requests (rounded up to even): the first asks of num_prompts / 2 items,
    then their second asks (module docstring)."""
    items = repeated_items(max((num_prompts + 1) // 2, 1), answer)
    return [item[0] for item in items] + [item[1] for item in items]
