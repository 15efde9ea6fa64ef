"""Where a continuous-batching decode step goes: the fused stack's matmuls, attention, the
output layer, and everything outside the model's forward, per step of C decoding rows.

Runs the serving engine (`--draft none`, greedy, prefix cache as `eyas serve` builds it) on C
MT-Bench prompts at once, each asked for --max-tokens with EOS ignored, so that every step after
the prompts' prefill decodes C rows and prefills nothing. Over those steps it reports medians of:
the step, the model's forward, inside it the C++ stack split by its own phase timers
(csrc/phase_timer.h: the int4 matmuls, the rounding of their activations, attention, norms,
rotary + KV writes, SiLU, residuals, waits at region ends), the final norm and embedding, the
output layer (the int8 screen for greedy rows), the rest of the forward (Python: positions,
rotary tables, reshapes), and outside the forward: batch building, acceptance and token-level
state, postprocessing (detokenisation, stop checks, outputs), scheduling and release.

With one thread (OMP_NUM_THREADS=1) use `--clock cpu`: every part on the thread's CPU time,
which other processes on a loaded machine do not inflate. With more threads `--clock wall`.

Usage:
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/profile-batched-step.py --concurrency 16 64 --clock cpu
    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/profile-batched-step.py --concurrency 16 --clock wall
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

STACK_PHASES = ("qkv", "o", "gate_up", "down", "quantize", "attention", "norms", "rotary", "silu_mul",
                "residuals", "sync", "stack_other")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()

    import torch

    import eyas.models.llama as llama
    import eyas.scheduler.executor as executor_module
    import eyas.scheduler.loop as loop_module
    import eyas.scheduler.output as output_module
    import eyas.scheduler.scheduler as scheduler_module
    from eyas.engine.sampling import SamplingParams
    from eyas.engine.target import load_target
    from eyas.models import extension
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine
    from eyas.scheduler.measure import load_prompts

    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    target = load_target(args.model, dtype=args.dtype)
    model = target.model
    stack = model.fused_layers()
    native = extension.module()
    seconds: dict[str, float] = defaultdict(float)

    def wrap(owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def timed(*a, **k):
            started = now()
            try:
                return inner(*a, **k)
            finally:
                seconds[key] += now() - started
        setattr(owner, name, timed)

    wrap(type(stack), "run", "stack")
    wrap(llama.Transformer, "forward", "forward")
    wrap(llama.Transformer, "output_logits", "output")
    wrap(llama.RMSNorm, "forward", "norm_embed")
    wrap(executor_module, "build_ragged_batch", "batch")
    wrap(executor_module.StepExecutor, "_accept", "accept")
    wrap(executor_module.StepExecutor, "_draft", "draft")
    wrap(output_module.OutputProcessor, "process", "postprocess")
    wrap(scheduler_module.Scheduler, "schedule", "schedule")
    wrap(loop_module.StepLoop, "_release", "release")

    steps: list[dict[str, float]] = []
    original_step = loop_module.StepLoop.step

    def step(self) -> None:
        seconds.clear()
        native.phase_seconds(reset=True)
        started = now()
        original_step(self)
        record = dict(seconds, step=now() - started)
        record.update(native.phase_seconds(reset=True))
        steps.append(record)
    loop_module.StepLoop.step = step

    native.set_phase_timing(True, args.clock)
    results = []
    for concurrency in args.concurrency:
        config = EngineConfig(max_running=concurrency)
        engine = Engine(target, config, draft="none")
        prompts = load_prompts(target, "mtbench", 80)
        prompts = (prompts * (concurrency // len(prompts) + 1))[:concurrency]
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        warmup = [engine.submit(prompt, SamplingParams(max_tokens=4, ignore_eos=True)) for prompt in prompts[:2]]
        engine.run(stop_when=lambda: all(r.done for r in warmup))
        steps.clear()
        requests = [engine.submit(prompt, params) for prompt in prompts]
        engine.run(stop_when=lambda: all(r.done for r in requests))
        # decode steps (a ragged pass was built) past the prompts' prefill; steps that also
        # prefilled (a forward well above the median) are left out
        decoded = [s for s in steps if "batch" in s][concurrency // 4:]
        typical = statistics.median(s["forward"] for s in decoded)
        full = [s for s in decoded if s["forward"] < 1.5 * typical]

        def ms(key: str) -> float:
            return 1e3 * statistics.median(s.get(key, 0.0) for s in full)

        row = {"concurrency": concurrency, "clock": args.clock, "threads": torch.get_num_threads(),
               "steps": len(full), "step": ms("step"), "forward": ms("forward"), "stack": ms("stack")}
        for phase in STACK_PHASES:
            row[phase] = ms(phase)
        row["matmuls"] = sum(row[p] for p in ("qkv", "o", "gate_up", "down", "quantize"))
        for key in ("output", "norm_embed", "batch", "accept", "draft", "postprocess", "schedule", "release"):
            row[key] = ms(key)
        row["forward_rest"] = row["forward"] - row["stack"] - row["norm_embed"]  # Python in the forward
        # the step less the forward and the output layer (which the executor calls), step by step
        row["outside_model"] = 1e3 * statistics.median(s["step"] - s["forward"] - s.get("output", 0.0) for s in full)
        row["tok_per_s_of_step"] = 1e3 * concurrency / row["step"]
        results.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        engine.shutdown()
        print(json.dumps(results[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
