"""Regeneration's input screening: a total --limit, duplicate ids, null/empty turns, the PII filter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eyas.cli.main import main
from eyas.data.pii.policy import PiiConfig
from eyas.data.prepare import PrepareConfig, run_prepare
from eyas.data.regenerate import RegenerateConfig, run_regenerate
from stub_server import StubServer, StubState
from test_regenerate import endpoint_config, read_output, write_prompts

SHORT_KEY = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIB7x\n-----END EC PRIVATE KEY-----"


def write_records(path: Path, records: list[Any]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def user_record(record_id: str, *contents: Any) -> dict[str, Any]:
    return {"id": record_id, "conversations": [{"role": "user", "content": c} for c in contents]}


def regenerate(url: str, tmp_path: Path, **options: Any) -> Any:
    config = RegenerateConfig(input=str(tmp_path / "in.jsonl"), output=tmp_path / "out.jsonl",
                              endpoint=endpoint_config(url), progress=False, **options)
    return run_regenerate(config)


def test_limit_is_the_total_in_the_output_and_a_rerun_adds_none(tmp_path: Path) -> None:
    write_prompts(tmp_path / "in.jsonl", 6, turns=1)
    state = StubState()
    with StubServer(state) as server:
        first = regenerate(server.url, tmp_path, limit=4)
        again = regenerate(server.url, tmp_path, limit=4)
        more = regenerate(server.url, tmp_path, limit=5)
    assert (first.written, again.written, more.written) == (4, 0, 1)
    assert again.limit_reached and not first.limit_reached and len(state.requests) == 5
    assert [record["id"] for record in read_output(tmp_path / "out.jsonl")] == ["r0", "r1", "r2", "r3", "r4"]
    assert (again.already_done, more.already_done) == (4, 4)
    saved = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert (saved["written"], saved["already_done"], saved["limit_reached"]) == (1, 4, False)


def test_duplicate_ids_are_skipped_and_counted_in_every_run(tmp_path: Path) -> None:
    write_records(tmp_path / "in.jsonl", [user_record("a", "first a"), user_record("b", "first b"),
                                          user_record("a", "second a"), user_record("c", "c"),
                                          user_record("b", "second b")])
    with StubServer(StubState()) as server:
        first = regenerate(server.url, tmp_path)
        rerun = regenerate(server.url, tmp_path)
    records = read_output(tmp_path / "out.jsonl")
    assert [record["id"] for record in records] == ["a", "b", "c"]
    assert records[0]["conversations"][0]["content"] == "first a"  # the first record under an id wins
    assert first.written == 3 and dict(first.rejected) == {"duplicate_id": 2}
    assert first.rejected_records == [{"line": 3, "id": "a", "reason": "duplicate_id"},
                                      {"line": 5, "id": "b", "reason": "duplicate_id"}]
    assert (rerun.written, rerun.already_done, dict(rerun.rejected)) == (0, 3, {"duplicate_id": 2})


def test_null_and_empty_turns_are_rejected_with_a_reason(tmp_path: Path) -> None:
    write_records(tmp_path / "in.jsonl", [
        user_record("ok", "a question"),
        user_record("null", "first", None),
        user_record("empty", ""),
        user_record("blank", "  \n "),
        {"question_id": 7, "turns": ["fine", ""]},  # MT-Bench shape
        {"id": "sharegpt", "conversations": [{"from": "human", "value": None}]},
    ])
    state = StubState()
    with StubServer(state) as server:
        report = regenerate(server.url, tmp_path)
    assert report.written == 1 and [r["id"] for r in read_output(tmp_path / "out.jsonl")] == ["ok"]
    assert dict(report.rejected) == {"empty_turn": 3, "null_turn": 2}
    assert [(bad["line"], bad["id"], bad["reason"]) for bad in report.rejected_records] == [
        (2, "null", "null_turn"), (3, "empty", "empty_turn"), (4, "blank", "empty_turn"),
        (5, "7", "empty_turn"), (6, "sharegpt", "null_turn")]
    assert [body["messages"][-1]["content"] for body in state.requests] == ["a question"]


def test_raw_input_goes_through_the_same_pii_filter_as_prepare(tmp_path: Path) -> None:
    write_records(tmp_path / "in.jsonl", [
        user_record("mail", "write to ada@example.org from 10.0.0.7"),
        user_record("key", "why is this rejected?\n" + SHORT_KEY),
        user_record("clean", "what is 2 + 2?"),
    ])
    state = StubState()
    with StubServer(state) as server:
        report = regenerate(server.url, tmp_path, pii=PiiConfig(ip_scope="all"))
    asked = [body["messages"][-1]["content"] for body in state.requests]
    assert asked == ["write to <EMAIL> from <IP_ADDRESS>", "what is 2 + 2?"]
    assert dict(report.rejected) == {"pii:PRIVATE_KEY": 1} and report.written == 2
    pii = report.pii.to_dict()
    assert (pii["records_scanned"], pii["records_redacted"], pii["records_dropped"]) == (3, 1, 1)
    assert {t: c["findings"] for t, c in pii["by_type"].items() if c["findings"]} == \
        {"PRIVATE_KEY": 1, "EMAIL": 1, "IP_ADDRESS": 1}
    # `eyas data prepare` with the same options keeps exactly these prompts.
    run_prepare(PrepareConfig(sources=[str(tmp_path / "in.jsonl")], output_dir=tmp_path / "prepared",
                              eval_ratio=0.0, workers=1, progress=False, pii=PiiConfig(ip_scope="all")))
    prepared = read_output(tmp_path / "prepared" / "train.jsonl")
    assert [record["conversations"][0]["content"] for record in prepared] == asked
    # --no-pii: the text reaches the target as written.
    state = StubState()
    (tmp_path / "out.jsonl").unlink()
    with StubServer(state) as server:
        report = regenerate(server.url, tmp_path, pii=PiiConfig(enabled=False))
    assert report.written == 3 and not report.pii.to_dict()["enabled"]
    assert state.requests[0]["messages"][-1]["content"] == "write to ada@example.org from 10.0.0.7"


def test_cli_regenerate_prints_rejections_and_pii_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_records(tmp_path / "in.jsonl", [user_record("a", "mail ada@example.org"), user_record("a", "again"),
                                          user_record("b", None), user_record("c", "see 192.168.1.20")])
    with StubServer(StubState()) as server:
        args = ["data", "regenerate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                "--endpoint", server.url, "--no-progress", "--limit", "2", "--pii-ip-scope", "all"]
        assert main(args) == 0
        first = capsys.readouterr().out
        assert main(args) == 0
        second = capsys.readouterr().out
    assert first.startswith("wrote 2 records (0 were already done)")
    assert "rejected: {'duplicate_id': 1, 'null_turn': 1}" in first
    assert "rejected records (line numbers): 2 (duplicate_id), 3 (null_turn)" in first
    assert "PII: 2 records scanned, 2 redacted, 0 dropped" in first
    assert "  EMAIL            findings      1  records      1  dropped    0" in first
    assert "  IP_ADDRESS       findings      1  records      1  dropped    0" in first
    assert "  PRIVATE_KEY      findings      0  records      0  dropped    0" in first
    assert second.startswith(f"{tmp_path / 'o.jsonl'} already holds --limit 2 records: nothing to do\n"
                             "wrote 0 records (2 were already done)")
    assert "PII: 0 records scanned" in second


def test_a_damaged_line_inside_the_output_is_a_one_line_error(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    write_prompts(tmp_path / "in.jsonl", 2, turns=1)
    (tmp_path / "out.jsonl").write_text('{"id": "r0", "conversations": []}\n{"id": "r1", "conv\n'
                                        '{"conversations": []}\n')
    args = ["data", "regenerate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
            "--endpoint", "http://127.0.0.1:9", "--no-progress"]
    assert main(args) == 2
    assert capsys.readouterr().err.startswith(f"eyas: error: {tmp_path / 'out.jsonl'} line 2 is not valid JSON")
    (tmp_path / "out.jsonl").write_text('{"id": "r0", "conversations": []}\n{"conversations": []}\n')
    assert main(args) == 2
    assert f"{tmp_path / 'out.jsonl'} line 2 has no 'id': this output cannot be resumed safely" in \
        capsys.readouterr().err
