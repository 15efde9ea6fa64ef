"""What the EAGLE-3 proposer costs per step: its propose() (catch-up over the accepted rows,
then the tree) and observe() times over single-stream decoding with every step drafting,
then a cProfile of the same calls (top functions by own time).

The fallback is off and the tree fixed (`--tree`), so every step drafts; the output is checked
against plain greedy decoding. Run it with PYTHONPATH pointing at another checkout to compare
two code trees on the same prompts.

Usage:
    OMP_NUM_THREADS=2 PYTHONPATH=. python scripts/profile-propose.py --tree chain:2 --num-prompts 4 \
        --max-tokens 96 [--top 15] [--no-profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft", default="eagle3:smollm2-135m")
    parser.add_argument("--tree", default="chain:2")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()

    from eyas.bench.prompts import load_prompt_set
    from eyas.engine.generate import SamplingParams, generate
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.methods import build_proposer
    from eyas.engine.speculative.policy import PolicyConfig
    from eyas.engine.target import load_target
    from eyas.models.tokenizer import chat_prompt_ids

    target = load_target(args.model, dtype="int4")
    questions = load_prompt_set("mtbench", args.num_prompts)
    prompts = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=args.max_tokens)
    proposer = build_proposer(args.draft, target, tree=args.tree)
    main_proposer = getattr(proposer, "main", proposer)
    plain = [generate(target, p, params).token_ids for p in prompts]

    times: dict[str, list[float]] = {"propose": [], "observe": []}
    original = {name: getattr(main_proposer, name) for name in times}

    def timed(name: str):
        def call(*args, **kwargs):
            started = time.perf_counter()
            out = original[name](*args, **kwargs)
            times[name].append(time.perf_counter() - started)
            return out
        return call

    def run() -> None:
        for prompt, expected in zip(prompts, plain):
            result = speculative_generate(target, prompt, params, proposer, 4, policy=PolicyConfig(enabled=False))
            assert result.token_ids == expected, "speculative output differs from plain"

    run()  # warm-up: tables, caches, the extension
    for name in times:
        setattr(main_proposer, name, timed(name))
    run()
    for name, values in times.items():
        # the first propose of a request catches up over its prompt: left out
        steady = sorted(values)[: int(len(values) * 0.95)] if name == "propose" else values
        print(f"{name}: {len(values)} calls, median {statistics.median(values) * 1e3:.3f} ms, "
              f"mean (95% fastest) {statistics.mean(steady) * 1e3:.3f} ms")
    for name in times:
        setattr(main_proposer, name, original[name])
    if args.no_profile:
        return
    profile = cProfile.Profile()
    for name in times:
        setattr(main_proposer, name, profiled(profile, original[name]))
    run()
    stats = pstats.Stats(profile)
    calls = stats.stats  # type: ignore[attr-defined]
    proposes = sum(count for (file, _, function), (_, count, *_rest) in calls.items()
                   if function == "propose" and "eagle3" in file)
    print(f"\ncProfile of propose + observe over {proposes} propose calls (top {args.top} by own time):")
    stats.sort_stats("tottime").print_stats(args.top)


def profiled(profile: cProfile.Profile, method):
    def call(*args, **kwargs):
        profile.enable()
        try:
            return method(*args, **kwargs)
        finally:
            profile.disable()
    return call


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
