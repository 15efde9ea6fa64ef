"""Where a serving step's time goes beyond the target pass: in-process and through HTTP.

Runs the serving engine as `eyas serve --draft none` builds it (prefix cache on, greedy) under
a closed loop of C requests, and reports, over the steps that decode C rows and prefill
nothing: the step's wall and engine-thread CPU milliseconds, the decode pass's (the model's
forward, output layer included), and the rest split by stage. Through HTTP (`--http`), the
app runs in this process as `eyas serve` runs it (uvicorn on a thread, the engine on the main
thread) and `eyas bench serve` drives it from a second process; the CPU seconds of every
thread (engine, OpenMP workers, event loop) and of the client are reported too.

Timings on a shared machine are noisy: compare two code trees by running this script from
each, alternating, and quote ratios (the CPU columns move least).

Usage:
    PYTHONPATH=$PWD python scripts/step-overhead.py --concurrency 16
    PYTHONPATH=$PWD python scripts/step-overhead.py --concurrency 1 --http --num-prompts 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from eyas.utils.thread_cpu import thread_cpu_seconds

UNNAMED = "other threads (OpenMP workers)"  # how the threads Python did not start are listed

STAGES = {  # stage name -> (module, qualified function) timed on the engine thread
    "schedule": ("eyas.scheduler.scheduler", "Scheduler.schedule"),
    "executor": ("eyas.scheduler.executor", "StepExecutor.run"),
    "forward": ("eyas.models.llama", "Transformer.forward"),
    "output_layer": ("eyas.models.llama", "Transformer.output_logits"),
    "output_argmax": ("eyas.models.llama", "Transformer.greedy_tokens"),  # greedy rows: ints only
    "accept": ("eyas.scheduler.executor", "StepExecutor._accept"),
    "postprocess": ("eyas.scheduler.output", "OutputProcessor.process"),
    "release": ("eyas.scheduler.loop", "StepLoop._release"),
}


PASS_STAGES = ("forward", "output_layer", "output_argmax")  # the target pass; one inside another counts once


class Clock:
    """Wall and thread-CPU seconds per stage, on the engine thread only."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.thread = threading.get_ident()
        self.in_pass = 0  # pass stages open on the engine thread

    def wrap(self, name: str, function):
        clock = self
        part_of_pass = name in PASS_STAGES

        def timed(*args, **kwargs):
            if threading.get_ident() != clock.thread or (part_of_pass and clock.in_pass):
                return function(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            clock.in_pass += part_of_pass
            try:
                return function(*args, **kwargs)
            finally:
                clock.in_pass -= part_of_pass
                clock.wall[name] += time.perf_counter() - wall
                clock.cpu[name] += time.thread_time() - cpu
        return timed

    def install(self) -> None:
        import importlib

        for name, (module_name, qualified) in STAGES.items():
            owner_name, attribute = qualified.split(".")
            owner = getattr(importlib.import_module(module_name), owner_name)
            setattr(owner, attribute, self.wrap(name, getattr(owner, attribute)))

    def snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        return dict(self.wall), dict(self.cpu)


def profiled(function, path: str | None):
    """`function`, run under cProfile on the thread-CPU clock when `path` is set."""
    if path is None:
        return function

    def run(*args, **kwargs):
        import cProfile

        profile = cProfile.Profile(time.thread_time)
        try:
            return profile.runcall(function, *args, **kwargs)
        finally:
            profile.dump_stats(path)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--http", action="store_true", help="through the HTTP server and a client process")
    parser.add_argument("--profile", default=None,
                        help="write cProfile stats (thread CPU clock) of the engine thread to PATH "
                             "and, with --http, of the event loop thread to PATH.http")
    parser.add_argument("--label", default=os.environ.get("PYTHONPATH", "."))
    args = parser.parse_args()

    from eyas.engine.sampling import SamplingParams
    from eyas.engine.target import load_target
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine
    from eyas.scheduler.measure import load_prompts, run_closed_loop
    import eyas.scheduler.loop as loop_module

    target = load_target(args.model, dtype=args.dtype)
    clock = Clock()
    clock.install()
    steps: list[dict] = []
    stats_seen: list = []

    class Recorder:  # the engine's observer; in HTTP mode it forwards to the server's metrics
        def __init__(self, inner=None) -> None:
            self.inner = inner

        def step_finished(self, stats) -> None:
            stats_seen.append(stats)
            if self.inner is not None:
                self.inner.step_finished(stats)

        def __getattr__(self, name):
            inner = self.__dict__.get("inner")
            return getattr(inner, name) if inner is not None else (lambda *a, **k: None)

    original_step = loop_module.StepLoop.step

    def step(self) -> None:
        before = clock.snapshot()
        wall, cpu, seen = time.perf_counter(), time.thread_time(), len(stats_seen)
        original_step(self)
        if len(stats_seen) == seen:
            return
        after = clock.snapshot()
        record = {"wall": time.perf_counter() - wall, "cpu": time.thread_time() - cpu,
                  "stats": stats_seen[-1]}
        for kind, index in (("wall", 0), ("cpu", 1)):
            record[kind + "_stages"] = {name: after[index].get(name, 0.0) - before[index].get(name, 0.0)
                                        for name in STAGES}
        steps.append(record)

    loop_module.StepLoop.step = step
    config = EngineConfig(max_running=max(args.concurrency, 16))
    if args.http:
        from eyas.server.metrics import ServerMetrics

        observer = Recorder(ServerMetrics(args.model))
    else:
        observer = Recorder()
    engine = Engine(target, config, draft="none", observer=observer)
    prompts = load_prompts(target, "repeated", args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens)
    run_closed_loop(engine, prompts[:1], SamplingParams(max_tokens=8), 1)  # warm-up
    steps.clear()
    threads_before = thread_cpu_seconds(UNNAMED)
    client_cpu = 0.0
    if args.http:
        from eyas.server.app import ServerSettings, create_app
        from eyas.server.runner import BackgroundServer

        app = create_app(engine, ServerSettings(model_name=args.model), observer.inner, start_engine=False)
        server = BackgroundServer(app)
        if args.profile:
            server.thread = threading.Thread(target=profiled(server.server.run, args.profile + ".http"),
                                             name="eyas-http", daemon=True)
        server.start()
        threads_before = thread_cpu_seconds(UNNAMED)
        output_dir = tempfile.mkdtemp(prefix="step-overhead-")
        command = [sys.executable, "-m", "eyas", "bench", "serve", "--url", server.url,
                   "--dataset", "repeated", "--num-prompts", str(args.num_prompts),
                   "--max-tokens", str(args.max_tokens), "--concurrency", str(args.concurrency),
                   "--output-dir", output_dir, "--no-progress"]
        started, children = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        client = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        profiled(engine.run, args.profile)(stop_when=lambda: client.poll() is not None)
        seconds = time.perf_counter() - started
        client.wait()
        if client.returncode:
            print(client.stderr.read().decode()[-3000:], file=sys.stderr)
            return 1
        result = json.loads((Path(output_dir) / "result.json").read_text())["results"][0]
        tokens_per_s = result["output_throughput"]
        threads_after = thread_cpu_seconds(UNNAMED)
        server.stop()
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        client_cpu = (usage.ru_utime + usage.ru_stime) - (children.ru_utime + children.ru_stime)
        tpot = result.get("median_tpot_ms")
    else:
        started = time.perf_counter()
        run = profiled(run_closed_loop, args.profile)(engine, prompts, params, args.concurrency)
        seconds = time.perf_counter() - started
        tokens_per_s, tpot = run["tokens_per_s"], None
        threads_after = thread_cpu_seconds(UNNAMED)
    engine.shutdown()

    full = [s for s in steps if s["stats"].decode_rows == args.concurrency and s["stats"].prefill_tokens == 0]

    def median(values) -> float:
        values = list(values)
        return 1e3 * statistics.median(values) if values else float("nan")

    line = {"label": args.label, "mode": "http" if args.http else "in-process",
            "concurrency": args.concurrency, "tokens_per_s": round(tokens_per_s, 2),
            "seconds": round(seconds, 2), "full_steps": len(full)}
    if tpot is not None:
        line["median_tpot_ms"] = round(tpot, 2)
    for kind in ("wall", "cpu"):
        step_ms = median(s[kind] for s in full)
        forward_ms = median(sum(s[kind + "_stages"].get(name, 0.0) for name in PASS_STAGES) for s in full)
        line[f"step_{kind}_ms"] = round(step_ms, 3)
        line[f"pass_{kind}_ms"] = round(forward_ms, 3)
        line[f"outside_pass_{kind}_ms"] = round(median(
            s[kind] - sum(s[kind + "_stages"].get(name, 0.0) for name in PASS_STAGES) for s in full), 3)
        line[f"stages_{kind}_ms"] = {name: round(median(s[kind + "_stages"].get(name, 0.0) for s in full), 3)
                                     for name in STAGES}
    # Steps that also prefilled a prompt chunk (new requests joining): their share of the time
    decoding = [s for s in steps if s["stats"].decode_rows > 0]
    with_prefill = [s for s in decoding if s["stats"].prefill_tokens > 0]
    total = sum(s["wall"] for s in decoding)
    line["decode_steps"] = len(decoding)
    line["mean_decode_step_wall_ms"] = round(1e3 * total / max(len(decoding), 1), 3)
    line["steps_with_prefill"] = len(with_prefill)
    line["wall_share_of_steps_with_prefill"] = round(sum(s["wall"] for s in with_prefill) / total, 3) if total else 0.0
    line["thread_cpu_s"] = {name: round(threads_after[name] - threads_before.get(name, 0.0), 2)
                            for name in threads_after if threads_after[name] - threads_before.get(name, 0.0) > 0.005}
    if args.http:
        line["client_cpu_s"] = round(client_cpu, 2)
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
