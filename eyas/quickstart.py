"""`eyas quickstart`: the whole pipeline on the embedded default, small, in one command.

prepare ShareGPT prompts (PII filter) -> regenerate answers with the target -> render with its
chat template -> features -> train a small EAGLE-3 head -> evaluate it -> evaluate the shipped
head -> a short serving comparison (none, ngram, eagle3) -> one summary table.

Every step is an ordinary `eyas` command, run in this process; quickstart prints each one, so
the run can be repeated (or scaled up) by hand. A finished step leaves a marker in
OUT/.steps/; running quickstart again skips finished steps and continues the unfinished one
where it stopped (regenerate, features and train resume on their own).

Usage:
    from eyas.quickstart import QuickstartConfig, run_quickstart
    summary = run_quickstart(QuickstartConfig(out="runs/quickstart"))
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eyas.errors import EyasError
from eyas.utils.io import write_json_atomic, write_text_atomic

def shipped_head(model: str) -> str | None:
    """The head folder shipped for `model` (an alias), or None."""
    from eyas.eagle3.shipped import shipped_head_dir

    path = shipped_head_dir(model)
    return str(path) if path is not None else None


@dataclass
class QuickstartConfig:
    model: str = "smollm2-135m"
    out: str = "runs/quickstart"
    source: str = "sharegpt"  # what `eyas data prepare --source` reads
    source_limit: int = 2000  # records read from the source (PII-scanned)
    prompts: int = 48  # prompts whose answers are regenerated and trained on
    answer_tokens: int = 128  # most tokens per regenerated answer
    batch_size: int = 16  # regeneration batch
    draft_vocab_size: int = 4096
    ttt_steps: int = 4
    epochs: float = 3.0
    learning_rate: float = 1e-3
    eval_prompts: int = 8  # MT-Bench first turns, for both heads
    eval_tokens: int = 128
    tree: str = "auto"  # EAGLE-3 draft tree of both evaluations
    head: str | None = field(default=None)  # the shipped head; None: the one for `model`, if any
    serving: bool = True
    serve_prompts: int = 8
    serve_tokens: int = 64
    serve_concurrency: str = "1,4"
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("source_limit", "prompts", "answer_tokens", "batch_size", "eval_prompts",
                     "eval_tokens", "serve_prompts", "serve_tokens", "ttt_steps"):
            if getattr(self, name) < 1:
                raise EyasError(f"quickstart: {name.replace('_', '-')} must be >= 1")
        if self.epochs <= 0 or self.learning_rate <= 0:
            raise EyasError("quickstart: epochs and learning-rate must be > 0")
        if self.head is None:
            self.head = shipped_head(self.model)
        elif self.head == "none":
            self.head = None


@dataclass
class Step:
    name: str
    what: str
    argv: list[str]  # an `eyas` command line
    skip_reason: str | None = None


def plan_steps(config: QuickstartConfig) -> list[Step]:
    out = Path(config.out)
    quiet = [] if config.progress else ["--no-progress"]
    own_head = str(out / "train" / "head")
    steps = [
        Step("prepare", f"ShareGPT prompts, PII filtered ({config.source_limit} records read)",
             ["data", "prepare", "--source", config.source, "--output-dir", str(out / "prepared"),
              "--limit", str(config.source_limit), "--max-turns", "1", "--min-chars", "16",
              "--max-chars", "1500", "--workers", "1", *quiet]),
        Step("regenerate", f"answers by the target itself ({config.prompts} prompts)",
             ["data", "regenerate", "--input", str(out / "prepared" / "train.jsonl"),
              "--output", str(out / "regenerated.jsonl"), "--model", config.model,
              "--limit", str(config.prompts), "--batch-size", str(config.batch_size),
              # float32: batched decoding on a CPU is fastest there (PyTorch's int4 kernel slows
              # down past a few rows per call, old BENCHMARKS.md section 1); the weights are
              # the same.
              "--dtype", "float32",
              "--max-tokens", str(config.answer_tokens), *quiet]),
        Step("render", "the target's chat template, prompts masked out",
             ["data", "render", "--model", config.model, "--input", str(out / "regenerated.jsonl"),
              "--output", str(out / "train.tokenized.jsonl"), "--max-length", "1024"]),
        Step("features", "hidden-state features (offline store)",
             ["features", "--model", config.model, "--data", str(out / "train.tokenized.jsonl"),
              "--out", str(out / "features")]),
        Step("train", "a small EAGLE-3 head, training-time test",
             ["train", "--model", config.model, "--features", str(out / "features"),
              "--out", str(out / "train"), "--draft-vocab-size", str(config.draft_vocab_size),
              "--ttt-steps", str(config.ttt_steps), "--epochs", str(config.epochs),
              "--lr", str(config.learning_rate), "--save-every", "50", "--resume", *quiet]),
        Step("eval-own", "the head trained here, on MT-Bench",
             _eval_argv(config, f"eagle3:{own_head}", out / "eval-own", quiet)),
    ]
    no_head = None if config.head else f"no head is shipped for {config.model}"
    steps.append(Step("eval-shipped", "the shipped head, on MT-Bench",
                      _eval_argv(config, f"eagle3:{config.head}", out / "eval-shipped", quiet),
                      no_head))
    steps.append(Step("eval-shipped-ngram", "the shipped head with the prompt-lookup branch",
                      _eval_argv(config, f"eagle3:{config.head}+ngram", out / "eval-shipped-ngram",
                                 quiet), no_head))
    # the shipped head served as it does best on a CPU: with the prompt-lookup branch
    drafts = ["none", "ngram"] + ([f"eagle3-ngram=eagle3:{config.head}+ngram"] if config.head else [])
    steps.append(Step("serve-compare", f"eyas serve with {', '.join(d.split('=')[0] for d in drafts)}",
                      ["bench", "compare", "--model", config.model,
                       *[arg for d in drafts for arg in ("--draft", d)],
                       "--output-dir", str(out / "serving"), "--dataset", "mtbench",
                       "--num-prompts", str(config.serve_prompts), "--max-tokens",
                       str(config.serve_tokens), "--concurrency", config.serve_concurrency, *quiet],
                      None if config.serving else "--no-serving"))
    return steps


def _eval_argv(config: QuickstartConfig, draft: str, out: Path, quiet: list[str]) -> list[str]:
    return ["eval", "--model", config.model, "--draft", draft, "--tree", config.tree,
            "--num-prompts",
            str(config.eval_prompts), "--max-tokens", str(config.eval_tokens), "--output-dir",
            str(out), *quiet]


def run_quickstart(config: QuickstartConfig, restart: bool = False,
                   run_command: Callable[[list[str]], int] | None = None) -> dict[str, Any]:
    """Run (or resume) every step; returns the summary also written to OUT/summary.json."""
    if run_command is None:
        from eyas.cli.main import main as run_command
    out = Path(config.out)
    markers = out / ".steps"
    markers.mkdir(parents=True, exist_ok=True)
    steps = plan_steps(config)
    timings: dict[str, float] = {}
    for number, step in enumerate(steps, 1):
        marker = markers / f"{step.name}.json"
        header = f"[quickstart] {number}/{len(steps)} {step.name}: {step.what}"
        if step.skip_reason:
            print(f"{header} -- skipped ({step.skip_reason})", file=sys.stderr)
            continue
        if marker.is_file() and not restart:
            timings[step.name] = json.loads(marker.read_text())["seconds"]
            print(f"{header} -- done already ({marker})", file=sys.stderr)
            continue
        print(f"{header}\n  $ eyas {shlex.join(step.argv)}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            code = run_command(step.argv)
        except SystemExit as stop:  # argparse's own errors
            code = stop.code if isinstance(stop.code, int) else 2
        if code != 0:
            raise EyasError(f"quickstart step '{step.name}' failed (exit {code}); its output is "
                            f"above. Fix the cause and run quickstart again: finished steps are "
                            f"skipped and this one resumes")
        timings[step.name] = time.perf_counter() - started
        write_json_atomic(marker, {"argv": step.argv, "seconds": timings[step.name]})
    summary = collect_summary(config, timings)
    write_json_atomic(out / "summary.json", summary)
    write_text_atomic(out / "summary.md", format_summary(summary))
    return summary


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def collect_summary(config: QuickstartConfig, timings: dict[str, float]) -> dict[str, Any]:
    """The headline figures of each step, read back from the files the steps wrote."""
    out = Path(config.out)
    summary: dict[str, Any] = {"model": config.model, "out": str(out), "seconds": timings}
    prepared = _read_json(out / "prepared" / "report.json")
    if prepared:
        summary["prepared"] = dict(prepared.get("split", {}))
    regenerated = _read_json(Path(str(out / "regenerated.jsonl") + ".report.json"))
    if regenerated:
        summary["regenerated"] = {"written": regenerated.get("written", 0) + regenerated.get("already_done", 0),
                                  "tokens": regenerated.get("completion_tokens", 0),
                                  "tokens_per_s": regenerated.get("tokens_per_second", 0.0)}
    features = _read_json(out / "features" / "index.json")
    if features:
        shards = features.get("shards", [])
        summary["features"] = {"samples": sum(len(s.get("sample_ids", [])) for s in shards),
                               "bytes": sum(s.get("bytes", 0) for s in shards)}
    held_out = _last_held_out(out / "train" / "metrics.csv")
    if held_out is not None:
        summary["train"] = held_out
    for name in ("eval-own", "eval-shipped", "eval-shipped-ngram"):
        report = _read_json(out / name / "eval.json")
        if report:
            overall = report["overall"]
            summary[name] = {k: overall[k] for k in (
                "prompts", "tau", "plain_median_tokens_per_s", "spec_median_tokens_per_s",
                "speedup_median", "identical_outputs", "acceptance_rate_per_position")}
    serving: dict[str, Any] = {}
    for result in sorted((out / "serving").glob("*/result.json")):
        run = _read_json(result)
        if run:
            serving[result.parent.name] = {
                str(level): round(r["output_throughput"], 2)
                for level, r in zip(run["concurrency_levels"], run["results"])}
    if serving:
        summary["serving_output_tokens_per_s"] = serving
        summary["serving_report"] = str(out / "serving" / "report.md")
    return summary


def _last_held_out(metrics: Path) -> dict[str, Any] | None:
    """Step and estimated acceptance length of the last held-out evaluation in metrics.csv."""
    import csv

    try:
        with open(metrics, newline="") as handle:
            rows = [row for row in csv.DictReader(handle) if row.get("split") == "held_out"]
    except OSError:
        return None
    if not rows:
        return None
    return {"steps": int(rows[-1]["step"]), "held_out_accept_length": float(rows[-1]["accept_length"])}


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"# eyas quickstart: {summary['model']}", "", "| step | result | seconds |", "|---|---|---|"]
    seconds = summary["seconds"]

    def row(step: str, text: str) -> None:
        lines.append(f"| {step} | {text} | {seconds.get(step, 0):.0f} |")

    if "prepared" in summary:
        p = summary["prepared"]
        row("prepare", f"{p.get('train', 0)} train + {p.get('eval', 0)} eval prompts")
    if "regenerated" in summary:
        r = summary["regenerated"]
        row("regenerate", f"{r['written']} answers, {r['tokens']} tokens ({r['tokens_per_s'] or 0:.1f} tok/s)")
    if "render" in seconds:
        row("render", "chat template applied, loss mask on the answers")
    if "features" in summary:
        f = summary["features"]
        row("features", f"{f['samples']} samples, {f['bytes'] / 2**20:.1f} MiB")
    if "train" in summary:
        t = summary["train"]
        row("train", f"{t['steps']} steps; held-out estimated acceptance length "
                     f"{t['held_out_accept_length']:.2f}")
    for step, label in (("eval-own", "head trained here"), ("eval-shipped", "shipped head"),
                        ("eval-shipped-ngram", "shipped head + n-gram branch")):
        if step in summary:
            e = summary[step]
            row(step, f"{label}: tau {e['tau'] or 0:.2f}, {e['spec_median_tokens_per_s']:.1f} vs "
                      f"{e['plain_median_tokens_per_s']:.1f} tok/s plain ({e['speedup_median']:.2f}x), "
                      f"{e['identical_outputs']}/{e['prompts']} outputs identical to plain")
    if "serving_output_tokens_per_s" in summary:
        for label, levels in summary["serving_output_tokens_per_s"].items():
            text = ", ".join(f"c={c}: {v:.1f}" for c, v in levels.items())
            lines.append(f"| serve {label} | output tok/s {text} | |")
        row("serve-compare", f"report and plots: {summary['serving_report']}")
    lines += ["", f"Everything is under {summary['out']}/ (summary.json, summary.md)."]
    return "\n".join(lines) + "\n"
