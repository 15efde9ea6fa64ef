"""`eyas bench soak` for 15 s against a real `eyas serve` of the tiny model: mixed lengths,
streams, cancelled streams; nothing lost, no 5xx, the KV rows back to idle, memory sampled."""

from __future__ import annotations

import json

import pytest

from eyas.bench.soak import SoakConfig, default_drafts, metric, passed
from eyas.cli.main import main
from eyas.errors import EyasError


def test_a_short_soak_loses_nothing_and_returns_to_idle(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {word} a few times"}) + "\n"
                               for word in ("one", "two", "three", "four", "five")))
    output = tmp_path / "soak" / "report.json"
    code = main(["bench", "soak", "--model", str(tiny_model_dir), "--minutes", "0.25",
                 "--concurrency", "8", "--drafts", "none", "--dataset", f"jsonl:{prompts}",
                 "--min-tokens", "8", "--max-tokens", "64", "--cancel-share", "0.3",
                 "--sample-seconds", "2", "--server-flags", "--dtype float32 --max-running 4",
                 "--output", str(output)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    report = json.loads(output.read_text())
    (section,) = report["methods"]
    assert section["draft"] == "none" and report["ok"] is True
    assert section["lost"] == 0 and section["http_5xx"] == 0 and section["http_4xx"] == 0
    assert section["finished"] > 10 and section["cancelled"] > 0
    assert section["sent"] == section["finished"] + section["cancelled"]
    assert section["kv_rows_in_use_end"] == 0 and section["request_failures"] == 0
    assert section["rss_mib_after_warmup"] > 50 and section["rss_mib_end"] > 50
    assert len(section["rss_samples"]) >= 3 and section["server_exit_code"] == 0
    assert section["kv_mib_end"] > 0 and section["rss_less_kv_growth_pct"] is not None
    assert section["timed_out"] == 0
    assert "| none |" in captured.out and "[soak] none:" in captured.err


def test_soak_settings_are_checked():
    with pytest.raises(EyasError, match="min tokens"):
        SoakConfig(min_tokens=300, max_tokens=256)
    with pytest.raises(EyasError, match="drafting method"):
        SoakConfig(drafts=[])
    assert default_drafts("smollm2-135m")[:3] == ["none", "ngram", "eagle3:smollm2-135m"]
    assert "eagle3:" not in " ".join(default_drafts("./some-other-model"))
    assert not passed({"draft": "x", "lost": 1, "http_5xx": 0, "kv_rows_in_use_end": 0})
    text = 'eyas:kv_rows_in_use{engine="0",model_name="m"} 3.0\nvllm:num_requests_running{a="b"} 0.0\n'
    assert metric(text, "eyas:kv_rows_in_use") == 3.0 and metric(text, "eyas:kv_rows") is None
