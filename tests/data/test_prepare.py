"""`eyas data prepare`: counts by source and reason, PII, dedup, split, errors, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_support import FIXTURES
from eyas.cli.main import main
from eyas.data.pii.policy import PiiConfig, parse_actions
from eyas.data.prepare import PrepareConfig, is_eval, run_prepare
from eyas.errors import EyasError


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prepare(tmp_path: Path, *names: str, **options: object) -> tuple[dict, list[dict]]:
    config = PrepareConfig(sources=[str(FIXTURES / name) for name in names], output_dir=tmp_path / "out",
                           workers=1, progress=False, **options)
    report = run_prepare(config).to_dict()
    records = read_jsonl(tmp_path / "out" / "train.jsonl") + read_jsonl(tmp_path / "out" / "eval.jsonl")
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report
    return report, records


def test_truncated_sharegpt_counts_every_drop_by_reason(tmp_path: Path) -> None:
    report, records = prepare(tmp_path, "sharegpt_truncated.json", eval_ratio=0.0)
    stats = report["sources"]["sharegpt_truncated"]
    assert stats["read"] == 8 and stats["kept"] == 3
    assert report["dropped"] == {"no_user_turn": 1, "malformed": 1, "duplicate": 1,
                                 "pii:AWS_ACCESS_KEY": 1, "truncated": 1}
    assert [(bad["line"], bad["reason"]) for bad in report["bad_records"]] == [
        (25, "unknown role 'alien' (accepted: assistant, bard, bing, chatgpt, gpt, human, model, prompter, "
             "system, user)"),
        (52, "truncated"),
    ]
    by_id = {record["id"]: record for record in records}
    assert sorted(by_id) == ["a1_0", "a2_0", "a7_0"]
    # User turns only (answers are regenerated), the e-mail redacted, the system prompt kept.
    assert by_id["a1_0"]["conversations"] == [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "user", "content": "And of Italy? Email me at <EMAIL>"},
    ]
    assert [m["role"] for m in by_id["a2_0"]["conversations"]] == ["system", "user"]
    pii = report["pii"]
    assert pii["by_type"]["EMAIL"] == {"findings": 2, "records": 2, "records_dropped": 0}
    assert pii["by_type"]["AWS_ACCESS_KEY"] == {"findings": 1, "records": 1, "records_dropped": 1}
    assert "ada@example.org" not in json.dumps(report) and "AKIA" not in json.dumps(report)


def test_whole_conversations_and_turn_limit(tmp_path: Path) -> None:
    report, records = prepare(tmp_path, "specforge.jsonl", keep="conversation", max_turns=1,
                              eval_ratio=0.0, pii=PiiConfig(actions=parse_actions("PHONE=keep")))
    by_id = {record["id"]: record for record in records}
    assert sorted(by_id) == ["sf-1", "sf-2", "sf-5"]
    assert [m["role"] for m in by_id["sf-2"]["conversations"]] == ["system", "user", "assistant"]
    assert report["dropped"] == {"invalid_json": 1, "malformed": 1}
    assert [bad["line"] for bad in report["bad_records"]] == [3, 4]


def test_user_mode_deduplicates_same_prompt_with_different_answers(tmp_path: Path) -> None:
    report, records = prepare(tmp_path, "specforge.jsonl", eval_ratio=0.0)
    assert sorted(r["id"] for r in records) == ["sf-1", "sf-2"]  # sf-5 asks what sf-1 asked
    assert report["dropped"]["duplicate"] == 1
    sf2 = next(r for r in records if r["id"] == "sf-2")
    assert sf2["conversations"][-1]["content"] == "Again, call me at <PHONE>."


def test_length_limits(tmp_path: Path) -> None:
    report, records = prepare(tmp_path, "specforge.jsonl", eval_ratio=0.0, min_chars=25)
    assert [r["id"] for r in records] == ["sf-2"]
    assert report["dropped"]["too_short"] == 2  # sf-1 and sf-5 (checked before deduplication)
    report, records = prepare(tmp_path, "specforge.jsonl", eval_ratio=0.0, max_chars=24)
    assert [r["id"] for r in records] == ["sf-1"] and report["dropped"]["too_long"] == 1


def test_split_is_deterministic_by_id(tmp_path: Path) -> None:
    ids = [f"id-{i}" for i in range(2000)]
    chosen = [i for i in ids if is_eval(i, 0.1, seed=0)]
    assert chosen == [i for i in ids if is_eval(i, 0.1, seed=0)]
    assert 150 < len(chosen) < 250
    assert chosen != [i for i in ids if is_eval(i, 0.1, seed=1)]
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"id": i, "conversations": [{"role": "user", "content": f"q {i}"}]}) + "\n"
                            for i in ids[:300]))
    config = dict(sources=[str(path)], eval_ratio=0.1, workers=1, progress=False)
    first = run_prepare(PrepareConfig(output_dir=tmp_path / "a", **config))
    second = run_prepare(PrepareConfig(output_dir=tmp_path / "b", **config))
    assert (tmp_path / "a" / "eval.jsonl").read_text() == (tmp_path / "b" / "eval.jsonl").read_text()
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "a" / "eval.jsonl")) == sorted(
        i for i in ids[:300] if is_eval(i, 0.1, 0))
    assert first.split == second.split


def test_workers_give_the_same_output(tmp_path: Path) -> None:
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        run_prepare(PrepareConfig(sources=[str(FIXTURES / "sharegpt_truncated.json")], output_dir=out,
                                  workers=workers, progress=False))
        outputs.append((out / "train.jsonl").read_text() + (out / "eval.jsonl").read_text())
    assert outputs[0] == outputs[1]


def test_a_source_with_no_usable_record_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "no conversation field"}\n{"conversations": [{"from": "gpt", "value": "a"}]}\n')
    with pytest.raises(EyasError, match=r"no usable record \(2 read; malformed: 1, no_user_turn: 1\)"):
        run_prepare(PrepareConfig(sources=[str(path)], output_dir=tmp_path / "out", workers=1, progress=False))
    assert not (tmp_path / "out" / "train.jsonl").exists()


def test_bad_options_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(EyasError, match="--keep must be one of user, conversation"):
        PrepareConfig(sources=["x"], output_dir=tmp_path, keep="assistant")
    with pytest.raises(EyasError, match="--eval-ratio"):
        PrepareConfig(sources=["x"], output_dir=tmp_path, eval_ratio=1.5)


def test_cli_prepare_prints_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["data", "prepare", "--source", str(FIXTURES / "sharegpt_truncated.json"), "--output-dir",
                 str(tmp_path), "--no-progress", "--workers", "1", "--pii", "EMAIL=drop"])
    out = capsys.readouterr().out
    assert code == 0
    assert "sharegpt_truncated read       8  kept       2" in out
    assert "pii:EMAIL" in out and "truncated" in out and "sharegpt_truncated:52 (truncated)" in out
    assert main(["data", "prepare", "--source", str(FIXTURES / "openai.jsonl"), "--output-dir", str(tmp_path),
                 "--pii", "EMAIL=shred"]) == 2
    assert "unknown PII action 'shred'" in capsys.readouterr().err
