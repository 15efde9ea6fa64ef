"""Serving through HTTP against the same engine in-process, alternated in one process.

One target, two engines built alike (`--draft none`, greedy, no prefix cache so that repeated
rounds reuse nothing): one driven in-process by a closed loop of C requests
(eyas.scheduler.measure), one behind the app, run as `eyas serve` runs it (uvicorn on a
thread, the engine on the main thread) and driven by `eyas bench serve` from a second process
(one client per `--clients` entry). Every round runs each configuration once, each round
starting one configuration later. Reported per configuration: the median round's output
tokens/s and its ratio to the in-process median, median TPOT, and CPU milliseconds per output
token of the engine thread, its OpenMP workers, the HTTP thread (event loop) and the client's
sweep (the client process's own measure, start-up excluded).

Usage:
    PYTHONPATH=$PWD python scripts/http-vs-engine.py --concurrency 1 4 16 --rounds 3
    PYTHONPATH=$PWD python scripts/http-vs-engine.py --concurrency 1 --clients raw httpx
    PYTHONPATH=$PWD python scripts/http-vs-engine.py --concurrency 1 16 --trace --servers h11/asyncio httptools/uvloop
                                                   # two servers in front of one engine
    PYTHONPATH=$PWD python scripts/http-vs-engine.py --switch-interval-ms 0.5   # the GIL's, too
    PYTHONPATH=OTHER_TREE python scripts/http-vs-engine.py --clients default   # a tree whose
                                                   # `bench serve` has no --client flag
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from eyas.utils.thread_cpu import thread_cpu_seconds


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    groups = {"MainThread": "engine", "openmp": "openmp", "eyas-http": "http"}
    delta: dict[str, float] = defaultdict(float)
    for name, value in after.items():
        delta[groups.get(name, "other")] += value - before.get(name, 0.0)
    return dict(delta)


class StepTrace:
    """Each step's pass as the engine thread ran it: wall and thread-CPU seconds at its start
    and end, decode rows, prefill chunks and prompt tokens (a wrapper around the engine's
    StepExecutor.run)."""

    def __init__(self, engine) -> None:
        self.steps: list[tuple[float, float, float, float, int, int, int]] = []
        run = engine.executor.run

        def traced(plan):
            started, started_cpu = time.perf_counter(), time.thread_time()
            try:
                return run(plan)
            finally:
                self.steps.append((started, time.perf_counter(), started_cpu, time.thread_time(),
                                   len(plan.decode), len(plan.prefill),
                                   sum(chunk.end - chunk.start for chunk in plan.prefill)))
        engine.executor.run = traced

    def take(self, tokens: int) -> dict[str, float]:
        """Summary of the steps since the last take: how many, their rows, the median pass, and
        the engine thread's time between passes (one pass's end to the next one's start): within
        a request's decoding (the next step decodes), wall and the thread's own CPU, and before
        a step that only prefills (the engine idle until a request arrived)."""
        steps, self.steps = self.steps, []
        if not steps:
            return {}
        within = [(b[0] - a[1], b[2] - a[3]) for a, b in zip(steps, steps[1:]) if b[4]]
        idle = [b[0] - a[1] for a, b in zip(steps, steps[1:]) if not b[4]]
        prefill = [s for s in steps if s[5]]
        ms = lambda values: round(1e3 * statistics.median(values), 3) if values else 0.0  # noqa: E731
        return {"steps": len(steps), "prefill_steps": len(prefill),
                "decode_rows_per_step": round(statistics.mean(s[4] for s in steps), 2),
                "prompt_tokens_per_prefill_step": round(statistics.mean(s[6] for s in prefill), 1) if prefill else 0,
                "pass_ms": ms([s[1] - s[0] for s in steps]),
                "gap_ms": ms([wall for wall, _ in within]),
                "gap_cpu_ms": ms([cpu for _, cpu in within]),
                "gap_ms_per_token": round(1e3 * sum(wall for wall, _ in within) / max(tokens, 1), 3),
                "idle_before_prefill_ms": ms(idle),
                "idle_ms_per_token": round(1e3 * sum(idle) / max(tokens, 1), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", nargs="+", default=["raw"],
                        help="bench serve --client values; 'default' passes no flag")
    parser.add_argument("--json", default=None, help="write every round here")
    parser.add_argument("--servers", nargs="+", default=["auto/auto"],
                        help="one server each, as HTTP/LOOP: uvicorn's HTTP implementation (auto, h11, "
                             "httptools) and event loop (auto, asyncio, uvloop)")
    parser.add_argument("--switch-interval-ms", nargs="+", type=float, default=[],
                        help="also serve under these sys.setswitchinterval values (the GIL's)")
    parser.add_argument("--trace", action="store_true",
                        help="also report steps, rows per step and the engine's time between passes")
    args = parser.parse_args()

    from eyas.engine.sampling import SamplingParams
    from eyas.engine.target import load_target
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine
    from eyas.scheduler.measure import load_prompts, run_closed_loop
    from eyas.server.app import ServerSettings, create_app
    from eyas.server.metrics import ServerMetrics
    from eyas.server.runner import BackgroundServer

    target = load_target(args.model, dtype=args.dtype)

    def engine(observer=None) -> Engine:
        config = EngineConfig(max_running=max(16, *args.concurrency), prefix_caching=False)
        return Engine(target, config, draft="none", observer=observer)

    plain = engine()
    metrics = ServerMetrics(args.model)
    served = engine(metrics)
    prompts = load_prompts(target, "mtbench", args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens)
    run_closed_loop(plain, prompts[:2], SamplingParams(max_tokens=8), 1)  # warm-up
    servers = {spec: BackgroundServer(create_app(served, ServerSettings(model_name=args.model), metrics,
                                              start_engine=False), http=spec.split("/")[0],
                                      loop=spec.split("/")[-1]).start()
               for spec in args.servers}
    output_dir = Path(tempfile.mkdtemp(prefix="http-vs-engine-"))
    traces = {"in-process": StepTrace(plain), "http": StepTrace(served)} if args.trace else {}

    def in_process(concurrency: int) -> dict:
        before = thread_cpu_seconds()
        run = run_closed_loop(plain, prompts, params, concurrency)
        return {"tokens_per_s": run["tokens_per_s"], "tpot_ms": run["tpot_ms"], "tokens": run["tokens"],
                "cpu_s": cpu_delta(before, thread_cpu_seconds()),
                "steps": traces["in-process"].take(run["tokens"]) if traces else {}}

    def over_http(concurrency: int, client: str, http: str, num_prompts: int = args.num_prompts,
                  max_tokens: int = args.max_tokens) -> dict:
        out = output_dir / f"{client}-{concurrency}-{time.monotonic_ns()}"
        # No warm-up requests of the client's: the engine's CPU counts the measured requests alone.
        command = [sys.executable, "-m", "eyas", "bench", "serve", "--url", servers[http].url,
                   "--dataset", "mtbench", "--num-prompts", str(num_prompts),
                   "--max-tokens", str(max_tokens), "--concurrency", str(concurrency),
                   "--warmup", "0", "--tokenizer", "none", "--output-dir", str(out), "--no-progress"]
        if client != "default":
            command += ["--client", client]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        before = thread_cpu_seconds()
        served.run(stop_when=lambda: process.poll() is not None)
        after = thread_cpu_seconds()
        if process.wait():
            raise SystemExit(process.stderr.read().decode()[-3000:])
        result = json.loads((out / "result.json").read_text())["results"][0]
        cpu = cpu_delta(before, after)
        if "client_cpu_s" in result:
            cpu["client"] = result["client_cpu_s"]
        tokens = result["total_output_tokens"]
        return {"tokens_per_s": result["output_throughput"], "tpot_ms": result["median_tpot_ms"],
                "tokens": tokens, "cpu_s": cpu, "steps": traces["http"].take(tokens) if traces else {}}

    default_interval = sys.getswitchinterval()

    def over_http_switching(concurrency: int, client: str, http: str, interval_s: float) -> dict:
        sys.setswitchinterval(interval_s)
        try:
            return over_http(concurrency, client, http)
        finally:
            sys.setswitchinterval(default_interval)

    configs = {"in-process": None}
    for client in args.clients:
        for http in args.servers:
            name = f"http-{client}" + (f"-{http}" if len(args.servers) > 1 else "")
            configs[name] = (client, http, default_interval)
            for interval_ms in args.switch_interval_ms:
                configs[f"{name}-switch{interval_ms:g}ms"] = (client, http, interval_ms / 1e3)
            over_http(1, client, http, num_prompts=2, max_tokens=8)  # warm-up: first requests, imports

    rows = []
    for concurrency in args.concurrency:
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for round_index in range(args.rounds):
            shift = round_index % len(configs)
            names = list(configs)
            for name in names[shift:] + names[:shift]:
                run = in_process(concurrency) if name == "in-process" else \
                    over_http_switching(concurrency, *configs[name])
                runs[name].append(run)
                print(json.dumps({"concurrency": concurrency, "config": name, "round": round_index,
                                  "tokens_per_s": round(run["tokens_per_s"], 2)}), flush=True)
        base = statistics.median(r["tokens_per_s"] for r in runs["in-process"])
        for name, rounds in runs.items():
            median = statistics.median(r["tokens_per_s"] for r in rounds)
            per_token = defaultdict(list)
            for r in rounds:
                for part, seconds in r["cpu_s"].items():
                    per_token[part].append(1e3 * seconds / max(r["tokens"], 1))
            row = {"concurrency": concurrency, "config": name, "tokens_per_s": round(median, 2),
                   "vs_in_process": round(median / base, 3),
                   "rounds_tokens_per_s": [round(r["tokens_per_s"], 2) for r in rounds],
                   "tpot_ms": round(statistics.median(r["tpot_ms"] for r in rounds), 2),
                   "cpu_ms_per_token": {part: round(statistics.median(v), 3) for part, v in per_token.items()}}
            if traces:
                keys = rounds[0]["steps"].keys()
                row["steps"] = {key: round(statistics.median(r["steps"].get(key, 0) for r in rounds), 3)
                                for key in keys}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for server in servers.values():
        server.stop()
    plain.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
