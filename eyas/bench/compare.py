"""`eyas bench compare`: start a server per drafting configuration, sweep each, one report.

Usage:
    from eyas.bench.compare import CompareConfig, run_compare
    run_compare(CompareConfig(model="smollm2-135m", drafts=["none", "ngram", "eagle3=eagle3:runs/head"],
                              output_dir="runs/bench/compare"))

For each draft configuration, in turn:
1. start the server command (by default `python -m eyas serve --model M --draft D --host
   127.0.0.1 --port P`, P a free port) as a child process, its output in `LABEL/server.log`;
2. wait until `GET /health` answers 200 (or the process exits, or `start_timeout` passes);
3. run the same sweep as `eyas bench serve` and write `LABEL/result.json`, report and plots;
4. stop the server (SIGTERM to its process group, SIGKILL after `stop_timeout`).
Then `report.md` and the plots in `output_dir` hold every configuration on the same axes. A
configuration whose server does not start is reported as not measured; the others go on.

A draft is `DRAFT` (also the label) or `LABEL=DRAFT`. `server_command` is a template with the
fields {python} {model} {draft} {host} {port}; it is split like a shell line, then each word is
filled in, so a path with spaces stays one argument. Any server that takes these fields fits
(e.g. `vllm serve {model} --port {port} ...` for a vLLM row).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from eyas.bench.report import load_run, write_report, write_run
from eyas.bench.serve_bench import run_serve_benchmark
from eyas.bench.serve_client import ServeBenchConfig, SweepConfig
from eyas.errors import EyasError

DEFAULT_SERVER_COMMAND = ("{python} -m eyas serve --model {model} --draft {draft} "
                          "--host {host} --port {port}")
TEMPLATE_FIELDS = ("python", "model", "draft", "host", "port")
HOST = "127.0.0.1"
LOG_TAIL_CHARS = 2000


@dataclass
class CompareConfig:
    model: str = "smollm2-135m"
    drafts: list[str] = field(default_factory=lambda: ["none", "ngram"])  # DRAFT or LABEL=DRAFT
    output_dir: str = "runs/bench/compare"
    server_command: str = DEFAULT_SERVER_COMMAND
    start_timeout: float = 900.0  # seconds until /health must answer (model loading included)
    stop_timeout: float = 30.0  # seconds between SIGTERM and SIGKILL
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def __post_init__(self) -> None:
        if not self.drafts:
            raise EyasError("give at least one --draft configuration (e.g. none, ngram)")
        labels = [parse_draft(draft)[0] for draft in self.drafts]
        if len(set(labels)) != len(labels):
            raise EyasError(f"--draft labels must differ, got {labels}; name them LABEL=DRAFT")
        try:
            self.server_command.format(**dict.fromkeys(TEMPLATE_FIELDS, "x"))
        except (KeyError, IndexError, ValueError) as error:
            raise EyasError(f"--server-command may only use the fields "
                            f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)}: {error}") from error
        if "{port}" not in self.server_command:
            raise EyasError("--server-command must contain {port}: the port is chosen per run")
        if self.start_timeout <= 0 or self.stop_timeout <= 0:
            raise EyasError("--start-timeout and --stop-timeout must be > 0 seconds")


def parse_draft(spec: str) -> tuple[str, str]:
    """'LABEL=DRAFT' or 'DRAFT' -> (label, draft); the label is also a folder name."""
    label, separator, draft = spec.partition("=")
    if not separator:
        label, draft = spec, spec
    label, draft = label.strip(), draft.strip()
    if not label or not draft:
        raise EyasError(f"bad --draft '{spec}'; expected DRAFT or LABEL=DRAFT")
    if not re.fullmatch(r"[A-Za-z0-9._+-]+", label):
        raise EyasError(f"--draft label '{label}' may only hold letters, digits and . _ + -; "
                        f"name it LABEL=DRAFT")
    return label, draft


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def server_argv(template: str, model: str, draft: str, port: int) -> list[str]:
    values = {"python": sys.executable, "model": model, "draft": draft, "host": HOST, "port": port}
    return [word.format(**values) for word in shlex.split(template)]


class ManagedServer:
    """A server child process on 127.0.0.1 that is healthy inside the `with` block."""

    def __init__(self, argv: list[str], port: int, log_path: Path, start_timeout: float,
                 stop_timeout: float) -> None:
        self.argv, self.port, self.log_path = argv, port, log_path
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-LOG_TAIL_CHARS:].strip() or "(no output)"

    def __enter__(self) -> ManagedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            try:
                # Own session: the whole group (a server may fork workers) is stopped together.
                self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as error:
                raise EyasError(f"cannot start {shlex.join(self.argv)}: {error}") from error
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                if self.process.poll() is not None:
                    raise EyasError(f"server exited with code {self.process.returncode} before "
                                    f"answering /health; {self.log_path} ends with:\n{self.log_tail()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise EyasError(f"server did not answer {self.url}/health within "
                                    f"{self.start_timeout:g} s (--start-timeout); {self.log_path} "
                                    f"ends with:\n{self.log_tail()}")
                time.sleep(0.25)

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)  # the group this object started, by its id
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


def run_compare(config: CompareConfig, progress: bool = True) -> dict[str, Any]:
    """Sweep every draft configuration; returns {"runs": [...], "failures": {label: reason}}."""
    output_dir = Path(config.output_dir)
    runs: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for spec in config.drafts:
        label, draft = parse_draft(spec)
        port = free_port()
        argv = server_argv(config.server_command, config.model, draft, port)
        print(f"[eyas] {label}: starting {shlex.join(argv)}")
        try:
            with ManagedServer(argv, port, output_dir / label / "server.log",
                               config.start_timeout, config.stop_timeout) as server:
                bench = ServeBenchConfig(url=server.url, label=label, sweep=replace(config.sweep))
                run = run_serve_benchmark(bench, progress=progress)
        except EyasError as error:
            print(f"[eyas] {label}: not measured: {error}")
            failures[label] = str(error).splitlines()[0]
            continue
        run["server_command"] = shlex.join(argv)
        run["draft"] = draft
        write_run(run, output_dir / label)
        runs.append(load_run(output_dir / label / "result.json"))
    if not runs:
        raise EyasError(f"no configuration could be measured: {failures}")
    write_report(runs, output_dir, failures)
    return {"runs": runs, "failures": failures}
