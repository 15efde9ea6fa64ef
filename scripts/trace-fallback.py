"""Per-step trace of single-stream speculation against plain decoding, in one process.

For each prompt, plain decoding and each speculative system run in turn (interleaved, as
`eyas bench offline` runs them). Every decode step of a speculative system is logged: the
draft tree's size, the tokens it emitted, its wall time, the proposer's propose time (head
catch-up included), whether the policy or the proposer made it plain, and the policy's state.
The summary splits the speculative run's time by kind of step and prices each kind against
the plain system's median step, so that the milliseconds lost show where they go.

`--cpu-clock` (one thread): every clock the engine decides by (step times, the cost model's
measurements, cached apart from the wall-clock ones) and the requests' times read the thread's
CPU time instead of the wall: on a machine shared with other jobs, a one-thread run then
decides and measures as it would on a quiet core.

Usage:
    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/trace-fallback.py --num-prompts 16 --max-tokens 128 \
        --systems "eagle3:smollm2-135m+ngram" --output runs/trace.json [--cpu-clock]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--systems", default="eagle3:smollm2-135m+ngram", help="';'-separated --draft specs")
    parser.add_argument("--output", default=None, help="JSON file of every step")
    parser.add_argument("--cpu-clock", action="store_true", help="decide and measure by thread CPU time")
    args = parser.parse_args()
    clock = time.perf_counter
    if args.cpu_clock:
        clock = use_cpu_clock()

    from eyas.bench.prompts import load_prompt_set
    from eyas.engine.generate import SamplingParams, generate
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.methods import build_proposer
    from eyas.engine.target import load_target
    from eyas.models.tokenizer import chat_prompt_ids
    from eyas.scheduler.executor import StepExecutor

    target = load_target(args.model, dtype=args.dtype)
    questions = load_prompt_set(args.dataset, args.num_prompts)
    prompts = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=args.max_tokens)
    systems = [s for s in args.systems.split(";") if s]
    proposers = {s: build_proposer(s, target) for s in systems}

    steps: list[dict] = []
    current = {"system": "plain", "prompt": -1}
    original_timed, original_propose = StepExecutor._timed, StepExecutor._propose

    def timed(self, request, tree, emitted, draft_seconds, verify_seconds, step_seconds):
        timing = request.timing
        before = None if timing is None else (timing.plain_left, timing.current_backoff)
        original_timed(self, request, tree, emitted, draft_seconds, verify_seconds, step_seconds)
        main = getattr(request.proposer, "main", request.proposer)
        choice = getattr(main, "choice", None)
        steps.append({**current, "size": int(tree.size), "emitted": emitted, "seconds": step_seconds,
                      "propose": request_propose.pop(request.request_id, None),
                      "policy_plain": before is not None and before[0] > 0,
                      "backoff": None if before is None else before[1],
                      "depth": None if choice is None else choice.depth})

    request_propose: dict[str, float] = {}

    def propose(self, request, budget, steady, priced=False):
        started = clock()
        tree = original_propose(self, request, budget, steady, priced)
        request_propose[request.request_id] = clock() - started
        return tree

    StepExecutor._timed, StepExecutor._propose = timed, propose
    walls: dict[str, list[float]] = {"plain": [], **{s: [] for s in systems}}
    tokens: dict[str, list[int]] = {"plain": [], **{s: [] for s in systems}}
    generate(target, prompts[0], SamplingParams(max_tokens=8))  # warm-up
    for index, ids in enumerate(prompts):
        current.update(system="plain", prompt=index)
        started = clock()
        plain = generate(target, ids, params).token_ids
        walls["plain"].append(clock() - started)
        tokens["plain"].append(len(plain))
        for system in systems:
            current.update(system=system, prompt=index)
            started = clock()
            result = speculative_generate(target, ids, params, proposers[system], args.num_draft_tokens)
            walls[system].append(clock() - started)
            tokens[system].append(len(result.token_ids))
            assert result.token_ids == plain, f"{system} differs from plain on prompt {index}"
    summarize(steps, walls, tokens, systems)
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"steps": steps, "walls": walls, "tokens": tokens}, handle)


def use_cpu_clock():
    """Point the engine's clocks at the thread's CPU time; the cost model is then measured in
    CPU time too, into a cache of its own."""
    import types

    import eyas.engine.speculative.proposers.eagle3 as eagle3
    import eyas.engine.speculative.sizing as sizing
    import eyas.scheduler.executor as executor
    import eyas.scheduler.output as output

    if torch.get_num_threads() != 1:
        raise SystemExit("--cpu-clock reads one thread's CPU time: set OMP_NUM_THREADS=1")
    shim = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    shim.perf_counter = time.thread_time
    for module in (eagle3, sizing, executor, output):
        module.time = shim
    wall_path = sizing.cost_cache_path
    sizing.cost_cache_path = lambda key: wall_path(key + "|thread-cpu-clock")
    return time.thread_time


def summarize(steps: list[dict], walls: dict, tokens: dict, systems: list[str]) -> None:
    plain_steps = [s["seconds"] for s in steps if s["system"] == "plain"]
    plain_step = statistics.median(plain_steps)
    rates = {name: [t / w for t, w in zip(tokens[name], walls[name])] for name in walls}
    print(f"threads {torch.get_num_threads()}; plain step median {plain_step * 1e3:.2f} ms over "
          f"{len(plain_steps)} steps; plain {statistics.median(rates['plain']):.1f} tok/s (median), "
          f"{sum(tokens['plain']) / sum(walls['plain']):.1f} (total)")
    for system in systems:
        mine = [s for s in steps if s["system"] == system]
        ratio = statistics.median(r / p for r, p in zip(rates[system], rates["plain"]))
        total = (sum(tokens[system]) / sum(walls[system])) / (sum(tokens["plain"]) / sum(walls["plain"]))
        print(f"\n{system}: {statistics.median(rates[system]):.1f} tok/s, {ratio:.3f}x median, "
              f"{total:.3f}x total; wall {sum(walls[system]):.2f} s vs plain {sum(walls['plain']):.2f} s")
        kinds: dict[str, list[dict]] = {}
        for index, step in enumerate(mine):
            first = index == 0 or mine[index - 1]["prompt"] != step["prompt"]
            if first:
                kind = "first step"
            elif step["size"]:
                kind = "drafted"
            elif step["policy_plain"]:
                kind = "plain (policy)"
            elif step["propose"] is not None:
                kind = "plain (proposer)"
            else:
                kind = "plain (other)"
            kinds.setdefault(kind, []).append(step)
        print(f"  {'kind':18} {'steps':>6} {'tokens':>7} {'ms/step':>8} {'ms/token':>9} "
              f"{'propose ms':>10} {'lost ms vs plain':>17}")
        for kind, group in sorted(kinds.items()):
            seconds = sum(s["seconds"] for s in group)
            emitted = sum(s["emitted"] for s in group)
            propose = [s["propose"] for s in group if s["propose"] is not None]
            lost = seconds - emitted * plain_step
            print(f"  {kind:18} {len(group):6d} {emitted:7d} {seconds / len(group) * 1e3:8.2f} "
                  f"{seconds / max(emitted, 1) * 1e3:9.2f} "
                  f"{(statistics.mean(propose) * 1e3 if propose else 0):10.2f} {lost * 1e3:17.1f}")
        outside = sum(walls[system]) - sum(s["seconds"] for s in mine)
        plain_outside = sum(walls["plain"]) - sum(plain_steps)
        print(f"  outside decode steps (prefill, setup): {outside * 1e3:.1f} ms vs plain {plain_outside * 1e3:.1f} ms")
        by_size: dict[int, list[dict]] = {}
        for step in mine:
            if step["size"]:
                by_size.setdefault(step["size"], []).append(step)
        for size, group in sorted(by_size.items()):
            print(f"    tree size {size}: {len(group)} steps, "
                  f"{statistics.median(s['seconds'] for s in group) * 1e3:.2f} ms median, "
                  f"{sum(s['emitted'] for s in group) / len(group):.2f} tokens/step")


if __name__ == "__main__":
    main()
