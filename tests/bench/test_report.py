"""The run JSON, markdown table and PNG plots hold the values that were measured."""

from __future__ import annotations

import copy
import json

import pytest

from bench_support import LEVELS
from eyas.bench.report import (THROUGHPUT_PLOT, TPOT_PLOT, build_figure, load_run,
                               markdown_report, unique_labels, write_report, write_run)
from eyas.errors import EyasError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VLLM_FIELDS = ("completed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "output_throughput", "duration", "input_lens", "output_lens", "ttfts", "itls", "errors",
               *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
                 for stat in ("mean", "median", "p90", "p99")))


def assert_png(path) -> None:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
    height, width, _ = imread(path).shape
    assert height > 100 and width > 100


def spec_variant(run):
    """A second configuration: the plain run relabelled, faster, with acceptance statistics."""
    other = copy.deepcopy(run)
    other["label"] = "eagle3"
    for result in other["results"]:
        result["mean_tpot_ms"] /= 2
        result["output_throughput"] *= 2
        result["acceptance_length"] = 2.5
        result["acceptance_rate_per_position"] = [0.9, 0.6]
    return other


def test_run_json_holds_the_measured_values(plain_run, tmp_path):
    paths = write_run(plain_run, tmp_path)
    assert {path.name for path in paths} == {"result.json", "report.md", TPOT_PLOT, THROUGHPUT_PLOT}
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved == plain_run
    for field in ("label", "date", "machine", "command", "model_id", "dataset_name", "max_tokens"):
        assert saved[field], field
    for result in saved["results"]:
        for field in (*VLLM_FIELDS, "max_concurrency", "acceptance_length",
                      "acceptance_rate_per_position"):
            assert field in result, field
    assert load_run(tmp_path / "result.json") == plain_run


def test_plots_are_pngs_of_the_measured_values(plain_run, tmp_path):
    write_run(plain_run, tmp_path)
    assert_png(tmp_path / TPOT_PLOT)
    assert_png(tmp_path / THROUGHPUT_PLOT)
    for field in ("mean_tpot_ms", "output_throughput"):
        (line,) = build_figure([plain_run], field, "y", "t").axes[0].get_lines()
        assert list(line.get_xdata()) == LEVELS
        assert list(line.get_ydata()) == [r[field] for r in plain_run["results"]]


def test_markdown_table_rows(plain_run):
    table = markdown_report([plain_run])
    for result in plain_run["results"]:
        row = (f"| plain | {result['max_concurrency']} | {result['completed']} | 0 | "
               f"{result['request_throughput']:.2f} | {result['output_throughput']:.1f} | "
               f"{result['mean_ttft_ms']:.1f} / {result['p99_ttft_ms']:.1f} | "
               f"{result['mean_tpot_ms']:.1f} / {result['p99_tpot_ms']:.1f} |")
        assert row in table
    assert "Acceptance rate per draft position" not in table  # a plain server has none


def test_merged_report_has_one_line_per_configuration(plain_run, tmp_path):
    runs = [plain_run, spec_variant(plain_run)]
    write_report(runs, tmp_path, failures={"medusa": "server exited with code 1"})
    figure = build_figure(runs, "mean_tpot_ms", "y", "t")
    lines = figure.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["plain", "eagle3"]
    assert list(lines[1].get_ydata()) == [r["mean_tpot_ms"] for r in runs[1]["results"]]
    report = (tmp_path / "report.md").read_text()
    assert "| eagle3 | 4 |" in report and "| 2.50 |" in report
    assert "| eagle3 | 1 | 0.90 0.60 |" in report
    assert "**medusa**: not measured: server exited with code 1" in report
    assert_png(tmp_path / THROUGHPUT_PLOT)


def test_repeated_labels_stay_apart():
    assert unique_labels([{"label": "a"}, {"label": "a"}, {"label": "b"}]) == ["a", "a (2)", "b"]


def test_load_run_rejects_other_files(tmp_path):
    with pytest.raises(EyasError, match="no such run file"):
        load_run(tmp_path / "absent.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(EyasError, match="is not JSON"):
        load_run(tmp_path / "broken.json")
    (tmp_path / "other.json").write_text(json.dumps({"results": [{"completed": 1}]}))
    with pytest.raises(EyasError, match="not a run of `eyas bench serve`"):
        load_run(tmp_path / "other.json")
