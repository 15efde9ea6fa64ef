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
    server = BackgroundServer(create_app(served, ServerSettings(model_name=args.model), metrics,
                                         start_engine=False)).start()
    output_dir = Path(tempfile.mkdtemp(prefix="http-vs-engine-"))

    def in_process(concurrency: int) -> dict:
        before = thread_cpu_seconds()
        run = run_closed_loop(plain, prompts, params, concurrency)
        return {"tokens_per_s": run["tokens_per_s"], "tpot_ms": run["tpot_ms"], "tokens": run["tokens"],
                "cpu_s": cpu_delta(before, thread_cpu_seconds())}

    def over_http(concurrency: int, client: str) -> dict:
        out = output_dir / f"{client}-{concurrency}-{time.monotonic_ns()}"
        command = [sys.executable, "-m", "eyas", "bench", "serve", "--url", server.url,
                   "--dataset", "mtbench", "--num-prompts", str(args.num_prompts),
                   "--max-tokens", str(args.max_tokens), "--concurrency", str(concurrency),
                   "--warmup", "1", "--tokenizer", "none", "--output-dir", str(out), "--no-progress"]
        if client != "default":
            command += ["--client", client]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        before = thread_cpu_seconds()
        served.run(stop_when=lambda: process.poll() is not None)
        after = thread_cpu_seconds()
        if process.wait():
            raise SystemExit(process.stderr.read().decode()[-3000:])
        result = json.loads((out / "result.json").read_text())["results"][0]
        cpu = cpu_delta(before, after)  # includes the warm-up round (short requests)
        if "client_cpu_s" in result:
            cpu["client"] = result["client_cpu_s"]
        return {"tokens_per_s": result["output_throughput"], "tpot_ms": result["median_tpot_ms"],
                "tokens": result["total_output_tokens"], "cpu_s": cpu}

    configs = ["in-process"] + [f"http-{client}" for client in args.clients]
    rows = []
    for concurrency in args.concurrency:
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for round_index in range(args.rounds):
            shift = round_index % len(configs)
            for name in configs[shift:] + configs[:shift]:
                run = in_process(concurrency) if name == "in-process" else \
                    over_http(concurrency, name.removeprefix("http-"))
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
            rows.append(row)
            print(json.dumps(row), flush=True)
    server.stop()
    plain.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
