"""Serving benchmark reports: the run JSON, a markdown table and PNG plots against concurrency.

Usage:
    paths = write_run(run, "runs/bench/eagle3")      # result.json + report.md + plots
    runs = [load_run(p) for p in ["a/result.json", "b/result.json"]]
    write_report(runs, "runs/bench/compare")         # report.md + plots, one line per run

Plots (matplotlib, Agg canvas, no display needed): mean TPOT against concurrency and output
throughput against concurrency, one line per configuration (the run's `label`), on a log2
concurrency axis. A level where no request completed is left out of the lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.utils.io import atomic_path, write_json_atomic

RESULT_FILE = "result.json"
REPORT_FILE = "report.md"
TPOT_PLOT = "tpot_vs_concurrency.png"
THROUGHPUT_PLOT = "output_throughput_vs_concurrency.png"
REQUIRED_LEVEL_FIELDS = ("max_concurrency", "completed", "output_throughput", "mean_tpot_ms")


def load_run(path: str | Path) -> dict[str, Any]:
    """Read a run JSON written by `eyas bench serve` (or `compare`), checking its shape."""
    path = Path(path)
    try:
        run = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise EyasError(f"no such run file: {path}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise EyasError(f"{path} is not JSON: {error}") from error
    results = run.get("results") if isinstance(run, dict) else None
    if not isinstance(results, list) or not all(
            isinstance(r, dict) and all(k in r for k in REQUIRED_LEVEL_FIELDS) for r in results):
        raise EyasError(f"{path} is not a run of `eyas bench serve`: it needs 'label' and "
                        f"'results' with {', '.join(REQUIRED_LEVEL_FIELDS)} per level")
    run.setdefault("label", path.parent.name or path.stem)
    return run


def unique_labels(runs: list[dict[str, Any]]) -> list[str]:
    """The runs' labels, with ' (2)', ' (3)' ... added to repeats so lines stay apart."""
    seen: dict[str, int] = {}
    labels = []
    for run in runs:
        label = str(run["label"])
        seen[label] = seen.get(label, 0) + 1
        labels.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return labels


def _pair(result: dict[str, Any], name: str) -> str:
    mean, p99 = result.get(f"mean_{name}_ms"), result.get(f"p99_{name}_ms")
    return "-" if mean is None else f"{mean:.1f} / {p99:.1f}"


def _number(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_report(runs: list[dict[str, Any]], failures: dict[str, str] | None = None) -> str:
    """One table row per (configuration, concurrency); the runs' settings above it."""
    lines = ["# Serving benchmark", ""]
    for label, run in zip(unique_labels(runs), runs):
        lines.append(f"- **{label}**: model `{run.get('model_id')}` at {run.get('base_url')} "
                     f"({run.get('backend')}), dataset {run.get('dataset_name')}, "
                     f"{run.get('num_prompts')} prompts per level, max_tokens "
                     f"{run.get('max_tokens')}, temperature {run.get('temperature')}, "
                     f"ignore_eos {run.get('ignore_eos')}; {run.get('date')}, {run.get('machine')}")
    for label, reason in (failures or {}).items():
        lines.append(f"- **{label}**: not measured: {reason}")
    lines += ["", "Times in ms as mean / p99. TPOT = (E2E - TTFT) / (output tokens - 1); ITL per "
              "token; acceptance length includes the bonus token.", "",
              "| configuration | concurrency | completed | failed | req/s | output tok/s | "
              "TTFT | TPOT | ITL | E2E | acceptance length |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    per_position = []
    for label, run in zip(unique_labels(runs), runs):
        for r in run["results"]:
            lines.append(f"| {label} | {r['max_concurrency']} | {r['completed']} | "
                         f"{r.get('failed', 0)} | {_number(r.get('request_throughput'))} | "
                         f"{_number(r.get('output_throughput'), 1)} | {_pair(r, 'ttft')} | "
                         f"{_pair(r, 'tpot')} | {_pair(r, 'itl')} | {_pair(r, 'e2el')} | "
                         f"{_number(r.get('acceptance_length'))} |")
            rates = r.get("acceptance_rate_per_position")
            if rates:
                per_position.append(f"| {label} | {r['max_concurrency']} | "
                                    f"{' '.join(f'{rate:.2f}' for rate in rates)} |")
    if per_position:
        lines += ["", "Acceptance rate per draft position (accepted at position i / drafts):", "",
                  "| configuration | concurrency | positions 0, 1, ... |", "|---|---|---|",
                  *per_position]
    return "\n".join(lines) + "\n"


def build_figure(runs: list[dict[str, Any]], field: str, ylabel: str, title: str) -> Any:
    """A matplotlib Figure with one line per run: `field` of each level against concurrency."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=110)
    axes = figure.subplots()
    levels: set[int] = set()
    for label, run in zip(unique_labels(runs), runs):
        points = [(r["max_concurrency"], r[field]) for r in run["results"]
                  if r.get(field) is not None and r.get("completed", 0) > 0]
        if points:
            xs, ys = zip(*points)
            axes.plot(xs, ys, marker="o", label=label)
            levels.update(xs)
    if levels:
        axes.set_xscale("log", base=2)
        axes.set_xticks(sorted(levels), [str(level) for level in sorted(levels)])
        axes.legend()
    axes.set_xlabel("concurrency (requests in flight)")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    return figure


PLOTS = (  # file, field, y label, title
    (TPOT_PLOT, "mean_tpot_ms", "mean TPOT (ms)", "Time per output token vs concurrency"),
    (THROUGHPUT_PLOT, "output_throughput", "output tokens / s", "Output throughput vs concurrency"),
)


def plot_runs(runs: list[dict[str, Any]], output_dir: str | Path) -> list[Path]:
    """Write the TPOT and output-throughput plots; returns their paths."""
    paths = []
    for name, field, ylabel, title in PLOTS:
        path = Path(output_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            build_figure(runs, field, ylabel, title).savefig(tmp, format="png")
        paths.append(path)
    return paths


def write_report(runs: list[dict[str, Any]], output_dir: str | Path,
                 failures: dict[str, str] | None = None) -> list[Path]:
    """report.md and both plots for `runs` in `output_dir`; returns the written paths."""
    if not runs:
        raise EyasError("no run to report")
    output_dir = Path(output_dir)
    report = output_dir / REPORT_FILE
    with atomic_path(report) as tmp:
        tmp.write_text(markdown_report(runs, failures))
    return [report, *plot_runs(runs, output_dir)]


def write_run(run: dict[str, Any], output_dir: str | Path) -> list[Path]:
    """result.json, report.md and both plots of one run in `output_dir`."""
    output_dir = Path(output_dir)
    write_json_atomic(output_dir / RESULT_FILE, run)
    return [output_dir / RESULT_FILE, *write_report([run], output_dir)]
