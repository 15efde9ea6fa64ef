"""Run lm-eval-harness on the local tasks through `eyas serve` and through transformers.

lm-eval lives in its own virtual environment (its pins are not eyas's); this script runs with
eyas's Python, builds the tasks (`tasks.py`), starts `eyas serve` once per drafting method,
points lm-eval's `local-completions` model at it, runs lm-eval's `hf` backend on the same
weights (the GGUF, dequantized to float32 by transformers, on the CPU), and prints one table
with how close each run's items are to the first system's. A run with a draft speculates on
every step (`--speculation always`) and does the generation task only (`--draft-tasks`).

Usage (make lm-eval does the set-up and runs the defaults):
    python -m eyas.bench.lmeval.compare --lm-eval-python .venv-lmeval/bin/python
    python -m eyas.bench.lmeval.compare --lm-eval-python .venv-lmeval/bin/python \\
        --systems hf eyas:none eyas:ngram --limit 20 --out runs/lmeval
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from eyas.bench.lmeval.tasks import ADDITION_TASK, ENDINGS_TASK, build_tasks
from eyas.errors import EyasError

# (task, lm-eval metric key) pairs reported, in table order.
METRICS = ((ENDINGS_TASK, "acc,none"), (ENDINGS_TASK, "acc_norm,none"), (ADDITION_TASK, "exact_match,strip"))


@dataclass
class CompareConfig:
    lm_eval_python: str
    model: str = "smollm2-135m"
    systems: list[str] = field(default_factory=lambda: ["hf", "eyas:none", "eyas:ngram"])
    tasks: list[str] = field(default_factory=lambda: [ENDINGS_TASK, ADDITION_TASK])
    out: Path = Path("runs/lmeval")
    limit: int | None = None
    batch_size: int = 8  # prompts per /v1/completions request, and the hf backend's batch
    threads: int | None = None  # torch threads of the server and of the hf run (None: torch's default)
    speculation: str = "always"  # eyas serve --speculation of runs with a draft: drafts on every step
    # Runs with a draft do only these of `tasks`: a loglikelihood request asks for one token
    # (max_tokens 1), which comes from the prefill, so drafts never run in multiple choice.
    draft_tasks: list[str] = field(default_factory=lambda: [ADDITION_TASK])

    def __post_init__(self) -> None:
        for system in self.systems:
            if system != "hf" and not system.startswith("eyas:"):
                raise ValueError(f"unknown system '{system}'; accepted: hf, eyas:DRAFT (eyas:none, eyas:ngram, ...)")
        if self.speculation not in ("auto", "always", "never"):
            raise ValueError(f"speculation must be auto, always or never, not '{self.speculation}'")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EyasError(f"eyas serve exited with code {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise EyasError(f"eyas serve was not healthy at {url} after {timeout:.0f} s")


def lm_eval_command(config: CompareConfig, model_type: str, model_args: str, output: Path,
                    task_dir: Path, tasks: list[str]) -> list[str]:
    command = [config.lm_eval_python, "-m", "lm_eval", "--model", model_type, "--model_args", model_args,
               "--include_path", str(task_dir), "--tasks", ",".join(tasks),
               "--batch_size", str(config.batch_size), "--output_path", str(output), "--log_samples"]
    if model_type == "hf":
        command += ["--device", "cpu"]
    if config.limit is not None:
        command += ["--limit", str(config.limit)]
    return command


def tasks_for(config: CompareConfig, draft: str) -> list[str]:
    """The tasks an eyas run does: all of them without a draft, else the draft tasks among them."""
    return config.tasks if draft == "none" else [task for task in config.tasks if task in config.draft_tasks]


def read_results(output: Path) -> dict[str, dict[str, float]]:
    """The newest results_*.json lm-eval wrote under `output`: {task: {metric: value}}."""
    files = sorted(output.rglob("results_*.json"), key=lambda path: path.stat().st_mtime)
    if not files:
        raise EyasError(f"lm-eval wrote no results under {output}")
    results = json.loads(files[-1].read_text())["results"]
    return {task: {key: value for key, value in metrics.items() if isinstance(value, (int, float))}
            for task, metrics in results.items()}


def read_samples(output: Path, task: str) -> dict[int, list]:
    """{doc_id: resps} of the newest samples file of `task` under `output` (--log_samples):
    per choice [[loglikelihood, is_greedy]] for multiple choice, [[text]] for generation."""
    files = sorted(output.rglob(f"samples_{task}_*.jsonl"), key=lambda path: path.stat().st_mtime)
    if not files:
        return {}
    records = (json.loads(line) for line in files[-1].read_text().splitlines() if line.strip())
    return {record["doc_id"]: record["resps"] for record in records}


def agreement(reference: dict[int, list], other: dict[int, list]) -> dict[str, float]:
    """How close two runs' per-item answers are: for loglikelihoods, the largest absolute
    difference and how many items pick the same choice; for generations, how many are equal."""
    shared = sorted(set(reference) & set(other))
    if not shared:
        return {}
    first = reference[shared[0]]
    if len(first[0][0]) == 2 and not isinstance(first[0][0], str):  # [[loglikelihood, is_greedy]] per choice
        values = [(float(a[0][0]), float(b[0][0])) for doc in shared for a, b in zip(reference[doc], other[doc])]
        same_choice = sum(_argmax(reference[doc]) == _argmax(other[doc]) for doc in shared)
        return {"items": len(shared), "max_abs_loglikelihood_diff": max(abs(a - b) for a, b in values),
                "same_choice": same_choice}
    same_text = sum(reference[doc] == other[doc] for doc in shared)
    return {"items": len(shared), "same_generation": same_text}


def _argmax(choices: list) -> int:
    scores = [float(choice[0][0]) for choice in choices]
    return scores.index(max(scores))


def run_hf(config: CompareConfig, gguf: Path, tokenizer: Path, task_dir: Path) -> tuple[list[str], dict]:
    model_args = (f"pretrained={gguf.parent},gguf_file={gguf.name},tokenizer={tokenizer},"
                  "dtype=float32")
    output = _output_dir(config, "hf")
    command = lm_eval_command(config, "hf", model_args, output, task_dir, config.tasks)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if config.threads:
        env.update(OMP_NUM_THREADS=str(config.threads))
    subprocess.run(command, check=True, env=env)
    return command, read_results(output)


def scrape_acceptance(base_url: str) -> dict:
    """The server's speculative-decoding counters since it started (acceptance length etc.)."""
    from eyas.bench.metrics_scrape import SpecDecodeCounters, acceptance_from_counters, parse_spec_counters

    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
            counters = parse_spec_counters(response.read().decode())
    except OSError:
        counters = None
    return acceptance_from_counters(SpecDecodeCounters(), counters)


def run_eyas(config: CompareConfig, draft: str, tokenizer: Path, task_dir: Path) -> tuple[list[str], dict, dict]:
    port = free_port()
    serve = [sys.executable, "-m", "eyas.cli.serve", "--model", config.model, "--dtype", "float32",
             "--draft", draft, "--port", str(port), "--log-level", "warning"]
    if draft != "none":
        serve += ["--speculation", config.speculation]
    env = dict(os.environ)
    if config.threads:
        env.update(OMP_NUM_THREADS=str(config.threads))
    server = subprocess.Popen(serve, env=env)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", server)
        model_args = (f"model={config.model},base_url=http://127.0.0.1:{port}/v1/completions,"
                      f"tokenizer_backend=huggingface,tokenizer={tokenizer},num_concurrent=1,"
                      "max_retries=1,timeout=600")
        output = _output_dir(config, "eyas:" + draft)
        command = lm_eval_command(config, "local-completions", model_args, output, task_dir,
                                  tasks_for(config, draft))
        subprocess.run(command, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
        acceptance = scrape_acceptance(f"http://127.0.0.1:{port}")
    finally:
        server.terminate()
        server.wait(timeout=60)
    return [*serve, "&&", *command], read_results(output), acceptance


def _output_dir(config: CompareConfig, system: str) -> Path:
    if system == "hf":
        return config.out / "hf"
    draft = system.split(":", 1)[1]
    return config.out / ("eyas-" + "".join(c if c.isalnum() or c in "-." else "_" for c in draft))


def compare(config: CompareConfig) -> dict:
    from eyas.models.registry import resolve_model
    from eyas.models.weight_source import gguf_file

    folder = resolve_model(config.model)  # config.json + tokenizer (the weights stay in a GGUF)
    gguf = gguf_file(folder)
    task_dir = config.out / "tasks"
    counts = build_tasks(task_dir)
    runs: dict[str, dict] = {}
    for system in config.systems:
        started = time.monotonic()
        if system == "hf":
            if gguf is None:
                raise EyasError("the hf run loads the target's GGUF; this model has none")
            command, results = run_hf(config, gguf, folder, task_dir)
            acceptance = None
        else:
            command, results, acceptance = run_eyas(config, system.split(":", 1)[1], folder, task_dir)
        runs[system] = {"command": shlex.join(command), "results": results, "speculative_decoding": acceptance,
                        "seconds": round(time.monotonic() - started, 1), "output": str(_output_dir(config, system))}
    reference = config.systems[0]
    for system in config.systems[1:]:
        runs[system]["agreement_with_" + reference] = {
            task: agreement(read_samples(Path(runs[reference]["output"]), task),
                            read_samples(Path(runs[system]["output"]), task))
            for task in config.tasks}
    summary = {"model": config.model, "items": counts, "limit": config.limit, "runs": runs}
    (config.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def table(summary: dict) -> str:
    header = "| system | " + " | ".join(f"{task} {key.split(',')[0]}" for task, key in METRICS) + " | seconds |"
    lines = [header, "|" + "---|" * (len(METRICS) + 2)]
    for system, run in summary["runs"].items():
        cells = []
        for task, key in METRICS:
            metrics = run["results"].get(task, {})
            value, stderr = metrics.get(key), metrics.get(key.replace(",", "_stderr,"))
            cells.append("-" if value is None else f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr else ""))
        lines.append(f"| {system} | " + " | ".join(cells) + f" | {run['seconds']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm-eval-python", default=os.environ.get("LM_EVAL_PYTHON", ".venv-lmeval/bin/python"),
                        help="the Python of the environment lm-eval is installed in (default: %(default)s)")
    parser.add_argument("--model", default="smollm2-135m", help="an eyas model with a GGUF (default: %(default)s)")
    parser.add_argument("--systems", nargs="+", default=["hf", "eyas:none", "eyas:ngram"],
                        help="hf and/or eyas:DRAFT, each run in turn (default: %(default)s)")
    parser.add_argument("--tasks", nargs="+", default=[ENDINGS_TASK, ADDITION_TASK])
    parser.add_argument("--out", type=Path, default=Path("runs/lmeval"))
    parser.add_argument("--limit", type=int, default=None, help="first N items of each task")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--speculation", default="always", choices=("auto", "always", "never"),
                        help="eyas serve --speculation of the runs with a draft (default: %(default)s)")
    parser.add_argument("--draft-tasks", nargs="+", default=[ADDITION_TASK],
                        help="the tasks runs with a draft do; multiple choice asks for one token, "
                             "which drafts never touch (default: %(default)s)")
    args = parser.parse_args(argv)
    config = CompareConfig(lm_eval_python=args.lm_eval_python, model=args.model, systems=args.systems,
                           tasks=args.tasks, out=args.out, limit=args.limit, batch_size=args.batch_size,
                           threads=args.threads, speculation=args.speculation,
                           draft_tasks=args.draft_tasks)
    if not Path(config.lm_eval_python).exists():
        raise SystemExit(f"no Python at {config.lm_eval_python}: make lm-eval creates .venv-lmeval "
                         "(or pass --lm-eval-python)")
    summary = compare(config)
    print(table(summary))
    for system, run in summary["runs"].items():
        print(f"{system}: {run['command']}")
        for key, value in run.items():
            if key.startswith("agreement_with_"):
                print(f"  {key}: {json.dumps({task: found for task, found in value.items() if found})}")
            elif key == "speculative_decoding" and value and value.get("spec_decode_num_drafts"):
                print(f"  {key}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
