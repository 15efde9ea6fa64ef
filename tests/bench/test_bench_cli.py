"""`eyas bench serve | plot | compare` through the CLI, against the synthetic server."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from eyas.bench.report import THROUGHPUT_PLOT, TPOT_PLOT, build_figure, load_run
from eyas.cli.main import main
from synthetic_server import Behaviour, SyntheticServer

SYNTHETIC_SCRIPT = Path(__file__).with_name("synthetic_server.py")


def run_cli(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def serve_args(url: str, prompts_file, output_dir, label: str) -> list[str]:
    return ["bench", "serve", "--url", url, "--label", label, "--dataset", f"jsonl:{prompts_file}",
            "--num-prompts", "4", "--concurrency", "1,2", "--tokenizer", "none", "--no-progress",
            "--output-dir", str(output_dir)]


def test_serve_then_plot(prompts_file, tmp_path, capsys):
    with SyntheticServer(Behaviour(ttft_ms=10, itl_ms=5, tokens=6)) as server:
        code, out, _ = run_cli(serve_args(server.url, prompts_file, tmp_path / "a", "plain"), capsys)
        assert code == 0
        assert "| plain | 1 | 4 | 0 |" in out and "| plain | 2 | 4 | 0 |" in out
        code, _, _ = run_cli(serve_args(server.url, prompts_file, tmp_path / "b", "again"), capsys)
        assert code == 0
    for name in ("result.json", "report.md", TPOT_PLOT, THROUGHPUT_PLOT):
        assert (tmp_path / "a" / name).stat().st_size > 0
    run = json.loads((tmp_path / "a" / "result.json").read_text())
    assert run["label"] == "plain" and [r["max_concurrency"] for r in run["results"]] == [1, 2]
    assert all(r["total_output_tokens"] == 24 for r in run["results"])

    code, out, _ = run_cli(["bench", "plot", str(tmp_path / "a" / "result.json"),
                            str(tmp_path / "b" / "result.json"), "--output-dir",
                            str(tmp_path / "both")], capsys)
    assert code == 0 and "| plain | 2 |" in out and "| again | 2 |" in out
    assert (tmp_path / "both" / TPOT_PLOT).read_bytes().startswith(b"\x89PNG")
    assert "| again | 1 |" in (tmp_path / "both" / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["bench", "serve", "--url", "localhost:8000"], "--url must look like http://HOST:PORT"),
    (["bench", "serve", "--url", "http://127.0.0.1:1", "--dataset", "alpaca"], "unknown dataset"),
    (["bench", "plot", "absent.json", "--output-dir", "x"], "no such run file"),
    (["bench", "compare", "--draft", "a=x", "--draft", "a=y"], "labels must differ"),
    (["bench", "compare", "--server-command", "serve --model {model}"], "must contain {port}"),
    (["bench", "compare", "--server-command", "serve {port} {gpu}"], "may only use the fields"),
])
def test_user_mistakes_exit_2_without_traceback(args, message, capsys):
    code, _, err = run_cli(args, capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_bad_concurrency_list(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--url", "http://127.0.0.1:1", "--concurrency", "1,two"])
    assert exit_info.value.code == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_offline_is_still_registered(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "offline", "--help"])
    assert exit_info.value.code == 0 and "--systems" in capsys.readouterr().out


def port_is_closed(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as probe:
        return probe.connect_ex((host, int(port))) != 0


def test_compare_starts_a_server_per_configuration(prompts_file, tmp_path, capsys):
    template = (f"{sys.executable} {SYNTHETIC_SCRIPT} --model {{model}} --draft {{draft}} "
                f"--host {{host}} --port {{port}} --ttft-ms 10 --itl-ms 10 --tokens 7")
    code, out, err = run_cli(["bench", "compare", "--model", "synthetic-model", "--draft", "none",
                              "--draft", "spec=ngram", "--draft", "broken=fail",
                              "--server-command", template, "--dataset", f"jsonl:{prompts_file}",
                              "--num-prompts", "4", "--concurrency", "1,2", "--tokenizer", "none",
                              "--start-timeout", "60", "--no-progress",
                              "--output-dir", str(tmp_path)], capsys)
    assert code == 2 and "not measured: broken" in err  # the report is written all the same
    assert "asked for a failed start" in (tmp_path / "broken" / "server.log").read_text()
    runs = [load_run(tmp_path / label / "result.json") for label in ("none", "spec")]
    assert [r["results"][0]["acceptance_length"] for r in runs] == [None, 3.0]  # 1 + 3 + 3 tokens
    assert runs[1]["results"][1]["acceptance_rate_per_position"] == [1.0, 1.0, 0.0, 0.0]
    assert all(port_is_closed(run["base_url"]) for run in runs)  # servers stopped
    report = (tmp_path / "report.md").read_text()
    assert "| none | 2 | 4 |" in report and "| spec | 2 | 4 |" in report
    assert "**broken**: not measured: server exited with code 1" in report
    lines = build_figure(runs, "output_throughput", "y", "t").axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["none", "spec"]
    assert (tmp_path / THROUGHPUT_PLOT).read_bytes().startswith(b"\x89PNG")
    assert "| spec | 1 |" in out
