"""`eyas data render`: samples with nothing to learn and oversized messages are skipped and counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eyas.cli.main import main
from eyas.data.templates import MAX_MESSAGE_CHARS


def write_conversations(path: Path, pairs: list[tuple[str, str, str]]) -> None:
    with open(path, "w") as handle:
        for record_id, question, answer in pairs:
            handle.write(json.dumps({"id": record_id, "conversations": [
                {"role": "user", "content": question}, {"role": "assistant", "content": answer}]}) + "\n")


def render(tmp_path: Path, capsys: pytest.CaptureFixture[str], *options: str) -> tuple[list[dict[str, Any]], str]:
    output = tmp_path / "rendered.jsonl"
    assert main(["data", "render", "--model", "smollm2-135m", "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(output), *options]) == 0
    return [json.loads(line) for line in output.read_text().splitlines()], capsys.readouterr().err


def test_truncation_to_zero_learned_tokens_is_counted_under_its_own_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # SmolLM2's template adds a ~20-token default system prompt; a 150-word question pushes the
    # answer past 60 tokens, a short one does not.
    write_conversations(tmp_path / "in.jsonl", [("short", "hi", "hello there"),
                                                ("long", " ".join(["word"] * 150), "an answer")])
    samples, report = render(tmp_path, capsys, "--max-length", "60")
    assert [sample["id"] for sample in samples] == ["short"]
    assert len(samples[0]["input_ids"]) <= 60 and sum(samples[0]["loss_mask"]) > 0
    assert "rendered 1 samples" in report and "skipped: {'no_learned_token_within_max_length': 1}" in report


def test_a_message_over_the_default_max_chars_is_dropped_and_counted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert MAX_MESSAGE_CHARS == 32_000
    write_conversations(tmp_path / "in.jsonl", [("ok", "hi", "hello"),
                                                ("huge", "x " * 20_000, "fine"),  # 40,000 characters
                                                ("edge", "y" * MAX_MESSAGE_CHARS, "kept")])
    samples, report = render(tmp_path, capsys)
    assert [sample["id"] for sample in samples] == ["ok", "edge"]
    assert "rendered 2 samples" in report and "skipped: {'message_too_long': 1}" in report
    samples, report = render(tmp_path, capsys, "--max-chars", "10")
    assert [sample["id"] for sample in samples] == ["ok"]
    assert "skipped: {'message_too_long': 2}" in report
    samples, report = render(tmp_path, capsys, "--max-chars", "0")  # no limit
    assert [sample["id"] for sample in samples] == ["ok", "huge", "edge"] and "skipped: none" in report
    assert main(["data", "render", "--model", "smollm2-135m", "--input", "x", "--max-chars", "-1"]) == 2
    assert "--max-chars must be >= 0" in capsys.readouterr().err
