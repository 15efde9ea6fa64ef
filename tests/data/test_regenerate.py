"""Regeneration: through an OpenAI-compatible stub server, and in-process with a tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eyas.cli.main import main
from eyas.data.endpoint import EndpointConfig, SamplingConfig, api_base
from eyas.data.regenerate import RegenerateConfig, run_regenerate
from eyas.errors import EyasError
from stub_server import StubServer, StubState, answer_text


def write_prompts(path: Path, count: int, turns: int = 2) -> list[str]:
    ids = [f"r{i}" for i in range(count)]
    with open(path, "w") as handle:
        for record_id in ids:
            messages = [{"role": "system", "content": "Be brief."}] + [
                {"role": "user", "content": f"{record_id} q{turn}"} for turn in range(turns)]
            handle.write(json.dumps({"id": record_id, "source": "test", "conversations": messages}) + "\n")
    return ids


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def endpoint_config(url: str, **options: Any) -> EndpointConfig:
    settings = {"concurrency": 1, "retries": 1, "timeout": 5.0, "backoff": 0.01, "max_consecutive_failures": 3}
    settings.update(options)
    return EndpointConfig(urls=[url], **settings)


def test_api_base_accepts_every_usual_spelling() -> None:
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/chat/completions"):
        assert api_base(url) == "http://h:8000/v1"


def test_multi_turn_is_regenerated_turn_by_turn_on_the_regenerated_history(tmp_path: Path) -> None:
    write_prompts(tmp_path / "in.jsonl", 3)
    state = StubState()
    with StubServer(state) as server:
        config = RegenerateConfig(input=str(tmp_path / "in.jsonl"), output=tmp_path / "out.jsonl",
                                  endpoint=endpoint_config(server.url, concurrency=2), progress=False,
                                  sampling=SamplingConfig(max_tokens=64, temperature=0.7, top_p=0.9, top_k=20, seed=1))
        report = run_regenerate(config)
    records = {record["id"]: record for record in read_output(tmp_path / "out.jsonl")}
    assert report.written == 3 and sorted(records) == ["r0", "r1", "r2"]
    conversation = records["r1"]["conversations"]
    first = answer_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "r1 q0"}])
    assert conversation[:3] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "r1 q0"},
                                {"role": "assistant", "content": first}]
    # Turn 2 was asked on the regenerated turn 1 (the stub's answer quotes the history it saw).
    assert conversation[3] == {"role": "user", "content": "r1 q1"}
    assert conversation[4]["content"] == answer_text(conversation[:4]) and first in conversation[4]["content"]
    assert records["r1"]["meta"]["regenerated"]["by"] == "endpoint:stub-model"
    body = state.requests[0]
    assert (body["model"], body["max_tokens"], body["temperature"], body["top_p"], body["top_k"], body["seed"]) == \
        ("stub-model", 64, 0.7, 0.9, 20, 1)
    saved = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert saved["written"] == 3 and saved["completion_tokens"] > 0


def test_endpoint_down_stops_and_a_resumed_run_writes_no_duplicate_and_loses_nothing(tmp_path: Path) -> None:
    ids = write_prompts(tmp_path / "in.jsonl", 6)
    output = tmp_path / "out.jsonl"
    # 1. The server dies after 5 answers: records 0 and 1 (2 turns each) are written, record 2 is not.
    with StubServer(StubState(fail_after=5, fail_status=503)) as server:
        config = RegenerateConfig(input=str(tmp_path / "in.jsonl"), output=output,
                                  endpoint=endpoint_config(server.url), progress=False)
        with pytest.raises(EyasError, match=r"failed 3 times in a row .*HTTP 503.*2 records written"):
            run_regenerate(config)
    assert [record["id"] for record in read_output(output)] == ["r0", "r1"]
    # 2. A kill in the middle of an append leaves a torn last line.
    with open(output, "a") as handle:
        handle.write('{"id": "r2", "source": "test", "conversa')
    # 3. Resumed against a healthy server: every record exactly once.
    state = StubState()
    with StubServer(state) as server:
        config = RegenerateConfig(input=str(tmp_path / "in.jsonl"), output=output,
                                  endpoint=endpoint_config(server.url, concurrency=3), progress=False)
        report = run_regenerate(config)
    written = [record["id"] for record in read_output(output)]
    assert sorted(written) == ids and len(written) == len(set(written))
    assert report.already_done == 2 and report.written == 4 and len(state.requests) == 8


def test_rejected_request_skips_only_that_record(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    write_prompts(path, 2, turns=1)
    with open(path, "a") as handle:
        handle.write(json.dumps({"id": "bad", "conversations": [{"role": "user", "content": "REJECT ME"}]}) + "\n")
        handle.write("{not json\n")
    with StubServer(StubState()) as server:
        report = run_regenerate(RegenerateConfig(input=str(path), output=tmp_path / "out.jsonl",
                                                 endpoint=endpoint_config(server.url), progress=False))
    assert report.written == 2 and dict(report.failed) == {"HTTP 400": 1} and report.malformed_lines == [4]


def test_timeouts_are_retried_then_stop_the_run(tmp_path: Path) -> None:
    write_prompts(tmp_path / "in.jsonl", 2, turns=1)
    with StubServer(StubState(fail_after=0, fail_status=0, hang_seconds=1.0)) as server:
        config = RegenerateConfig(input=str(tmp_path / "in.jsonl"), output=tmp_path / "out.jsonl",
                                  endpoint=endpoint_config(server.url, timeout=0.2, max_consecutive_failures=2),
                                  progress=False)
        with pytest.raises(EyasError, match="ReadTimeout"):
            run_regenerate(config)


def test_cli_regenerate_against_the_stub(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_prompts(tmp_path / "in.jsonl", 2)
    with StubServer(StubState()) as server:
        args = ["data", "regenerate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                "--endpoint", server.url, "--no-progress"]
        assert main(args) == 0
        assert main(args) == 0  # everything already done
    out = capsys.readouterr().out
    assert "wrote 2 records (0 were already done)" in out and "wrote 0 records (2 were already done)" in out
    assert main(["data", "regenerate", "--input", "x", "--output", "y"]) == 2
    assert "exactly one of --endpoint" in capsys.readouterr().err


def test_in_process_regeneration_with_a_tiny_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_prompts(tmp_path / "in.jsonl", 5)
    outputs = []
    # fixed batches of 2 and of 1, then the serving engine with 3 and 1 conversations in flight
    for name, batch_size, concurrency in (("a", 2, 1), ("b", 1, 1), ("engine3", None, 3), ("engine1", None, 1)):
        config = RegenerateConfig(input=str(tmp_path / "in.jsonl"), output=tmp_path / f"{name}.jsonl",
                                  model=str(tiny_model_dir), dtype="float32", batch_size=batch_size,
                                  concurrency=concurrency, progress=False,
                                  sampling=SamplingConfig(max_tokens=6))
        report = run_regenerate(config)
        assert report.written == 5 and report.completion_tokens > 0
        outputs.append(sorted(read_output(tmp_path / f"{name}.jsonl"), key=lambda r: r["id"]))
    # greedy: the same answers, batched or one at a time, fixed batches or the engine
    assert outputs[0] == outputs[1] == outputs[2] == outputs[3]
    conversation = outputs[0][0]["conversations"]
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user", "assistant"]
    assert all(m["content"] for m in conversation)
    assert outputs[0][0]["meta"]["regenerated"]["finish_reasons"][0] in ("stop", "length")


def test_engine_regeneration_resumes_and_counts_prompts_too_long(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_prompts(tmp_path / "in.jsonl", 4)
    with open(tmp_path / "in.jsonl", "a", encoding="utf-8") as handle:  # a prompt over the context
        handle.write(json.dumps({"id": "long", "conversations": [{"role": "user", "content": "word " * 5000}]}) + "\n")
    base = dict(input=str(tmp_path / "in.jsonl"), output=tmp_path / "out.jsonl", model=str(tiny_model_dir),
                dtype="float32", concurrency=4, progress=False, sampling=SamplingConfig(max_tokens=4))
    first = run_regenerate(RegenerateConfig(**base, limit=2))
    assert first.written == 2 and not first.failed
    second = run_regenerate(RegenerateConfig(**base))
    assert second.already_done == 2 and second.written == 2 and dict(second.failed) == {"prompt_too_long": 1}
    ids = [r["id"] for r in read_output(tmp_path / "out.jsonl")]
    assert len(ids) == len(set(ids)) == 4 and "long" not in ids


def test_in_process_batches_group_similar_lengths_window_by_window() -> None:
    from eyas.data.records import conversation_from_dict
    from eyas.data.regenerate import length_sorted_batches

    lengths = [50, 3, 40, 1, 30, 2, 20, 4, 9, 8]
    pending = [conversation_from_dict({"id": f"r{i}", "conversations": [{"role": "user", "content": "x" * n}]},
                                      "test", f"test-{i}") for i, n in enumerate(lengths)]
    batches = list(length_sorted_batches(pending, batch_size=2, window_batches=2))
    sizes = [[len(c.user_turns[0]) for c in batch] for batch in batches]
    # windows of 4 records in input order, each sorted by length, cut into batches of 2
    assert sizes == [[1, 3], [40, 50], [2, 4], [20, 30], [8, 9]]
    assert sorted(c.id for batch in batches for c in batch) == sorted(c.id for c in pending)


def test_engine_regeneration_with_a_seed_is_reproducible(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_prompts(tmp_path / "in.jsonl", 3)
    outputs = []
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        config = RegenerateConfig(input=str(tmp_path / "in.jsonl"), output=tmp_path / f"{name}.jsonl",
                                  model=str(tiny_model_dir), dtype="float32", concurrency=2, progress=False,
                                  sampling=SamplingConfig(max_tokens=8, temperature=1.0, seed=seed))
        assert run_regenerate(config).written == 3
        outputs.append(sorted((r["id"], r["conversations"]) for r in read_output(tmp_path / f"{name}.jsonl")))
    assert outputs[0] == outputs[1]  # the same seed: the same answers, whatever the scheduling
    assert outputs[0] != outputs[2]  # another seed: other answers (a random tiny model is far from peaked)


def test_device_is_for_the_in_process_target(tmp_path: Path) -> None:
    with pytest.raises(EyasError, match="--device cuda places the in-process target"):
        RegenerateConfig(input="x", output=tmp_path / "y.jsonl", endpoint=endpoint_config("http://127.0.0.1:1"),
                         device="cuda")
