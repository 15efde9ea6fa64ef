"""Two code trees' serving engine, alternated: output tokens/s and CPU per output token at C rows.

Each arm is a code tree (a checkout's root, put on PYTHONPATH); each run is a fresh process that
loads the target (int4 by default), keeps C MT-Bench requests in flight (closed loop, greedy,
`max_step_tokens` as `eyas data regenerate` sets it) until --num-prompts are answered, and
reports output tokens/s, the process's CPU milliseconds per output token (all its threads: with
OMP_NUM_THREADS=1 the number other processes on a loaded machine inflate least), and the median
CPU milliseconds of the engine's steps that decoded C rows and prefilled nothing. Arms alternate
round by round, the first arm first in odd rounds and second in even ones; the table gives
medians over rounds and the ratio of each arm to the first. Greedy outputs of every arm are
compared with the first arm's.

Usage:
    OMP_NUM_THREADS=1 python scripts/ab-batched-step.py --arm /path/to/base --arm . \
        --concurrency 16 64 --rounds 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time


def inner(args: argparse.Namespace) -> None:
    """One run in this process (the code on PYTHONPATH): print one JSON line."""
    import resource

    from eyas.engine.sampling import SamplingParams
    from eyas.engine.target import load_target
    import eyas.scheduler.loop as loop_module
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine
    from eyas.scheduler.measure import load_prompts, run_closed_loop

    target = load_target(args.model, dtype=args.dtype)
    concurrency = args.concurrency[0]
    engine = Engine(target, EngineConfig(max_running=concurrency, max_step_tokens=max(512, concurrency)),
                    draft="none")
    prompts = load_prompts(target, "mtbench", 80)
    prompts = (prompts * (args.num_prompts // len(prompts) + 1))[: args.num_prompts]
    run_closed_loop(engine, prompts[:2], SamplingParams(max_tokens=4), 2)  # warm-up
    step_cpu: list[float] = []
    original = loop_module.StepLoop.step

    def step(self) -> None:  # CPU of steps that decode every row and prefill nothing
        started = time.thread_time()
        self.last_stats = None
        original(self)
        stats = getattr(self, "last_stats", None)
        step_cpu.append((time.thread_time() - started, stats))
    executor_run = engine.executor.run

    def run(plan):
        result = executor_run(plan)
        engine.loop.last_stats = result.stats
        return result
    engine.executor.run = run
    loop_module.StepLoop.step = step
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_before = usage.ru_utime + usage.ru_stime
    result = run_closed_loop(engine, prompts, SamplingParams(max_tokens=args.max_tokens), concurrency)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - cpu_before
    engine.shutdown()
    full = [seconds for seconds, stats in step_cpu
            if stats is not None and stats.decode_rows == concurrency and stats.prefill_tokens == 0]
    outputs = result.get("outputs") or []
    digest = hashlib.sha1(json.dumps(outputs).encode()).hexdigest()[:12] if outputs else None
    tokens = result["tokens"] if "tokens" in result else round(result["tokens_per_s"] * result["seconds"])
    print(json.dumps({"tokens_per_s": result["tokens_per_s"], "cpu_ms_per_token": 1e3 * cpu / max(tokens, 1),
                      "full_step_cpu_ms": 1e3 * statistics.median(full) if full else None,
                      "full_steps": len(full), "outputs": digest}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", action="append", required=True, help="a code tree's root (twice or more)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--num-prompts", type=int, default=0, help="default: 2 x concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args)
        return 0
    for concurrency in args.concurrency:
        runs: dict[str, list[dict]] = {arm: [] for arm in args.arm}
        for round_number in range(args.rounds):
            order = args.arm if round_number % 2 == 0 else list(reversed(args.arm))
            for arm in order:
                env = dict(os.environ, PYTHONPATH=os.path.abspath(arm))
                command = [sys.executable, os.path.abspath(__file__), "--inner", "--arm", arm,
                           "--model", args.model, "--dtype", args.dtype, "--concurrency", str(concurrency),
                           "--num-prompts", str(args.num_prompts or 2 * concurrency),
                           "--max-tokens", str(args.max_tokens)]
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                runs[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"c={concurrency} round {round_number + 1} {arm}: {runs[arm][-1]}", flush=True)
        first = args.arm[0]
        print(f"\nc = {concurrency}, {os.environ.get('OMP_NUM_THREADS', 'default')} thread(s), "
              f"medians of {args.rounds} rounds")
        print("| arm | tok/s | CPU ms per output token | CPU ms per full decode step | outputs = first arm's |")
        print("|---|---|---|---|---|")
        base = {key: statistics.median(r[key] for r in runs[first])
                for key in ("tokens_per_s", "cpu_ms_per_token", "full_step_cpu_ms")}
        for arm in args.arm:
            values = {key: statistics.median(r[key] for r in runs[arm])
                      for key in ("tokens_per_s", "cpu_ms_per_token", "full_step_cpu_ms")}
            same = all(r["outputs"] == runs[first][0]["outputs"] for r in runs[arm])
            print(f"| {arm} | {values['tokens_per_s']:.1f} ({values['tokens_per_s'] / base['tokens_per_s']:.3f}x) "
                  f"| {values['cpu_ms_per_token']:.2f} ({values['cpu_ms_per_token'] / base['cpu_ms_per_token']:.3f}x) "
                  f"| {values['full_step_cpu_ms']:.1f} ({values['full_step_cpu_ms'] / base['full_step_cpu_ms']:.3f}x) "
                  f"| {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
