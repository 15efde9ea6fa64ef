"""Where a speculative step's time goes: plain decoding and one `--draft` method side by side,
every step drafted (the never-slower fallback off), phases timed around the executor's calls.

For each prompt, plain decoding then the method (outputs asserted equal); the totals of each
phase are printed in ms per emitted token: `step` (the executor's whole step), `draft` (the
proposer, head catch-up included), `verify` (the target's pass, its output layer and the
acceptance), `model_call` (the target's forward, prefill passes included), `output_logits`
(its output layer or int8 screen), `accept`, `prefill` and `wall` (the requests' wall time).

Usage:
    OMP_NUM_THREADS=2 PYTHONPATH=. python scripts/spec-phases.py --num-prompts 8 --max-tokens 128 \\
        --draft eagle3:smollm2-135m [--tree chain:1]
"""

from __future__ import annotations

import argparse
import collections
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--draft", default="eagle3:smollm2-135m")
    parser.add_argument("--tree", default=None, help="EAGLE-3 tree: auto, chain:K or DEPTH,TOPK,TOTAL")
    args = parser.parse_args()

    import eyas.engine.speculative.policy as policy
    from eyas.bench.prompts import load_prompt_set
    from eyas.engine.generate import SamplingParams, generate
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.methods import build_proposer
    from eyas.engine.target import load_target
    from eyas.models.tokenizer import chat_prompt_ids
    from eyas.scheduler.executor import StepExecutor

    checked = policy.PolicyConfig.__post_init__

    def fallback_off(config: policy.PolicyConfig) -> None:
        config.enabled = False
        checked(config)

    policy.PolicyConfig.__post_init__ = fallback_off
    target = load_target(args.model, dtype=args.dtype)
    prompts = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": q}])
               for q in load_prompt_set("mtbench", args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens)
    proposer = build_proposer(args.draft, target, tree=args.tree)
    seconds: dict[str, collections.Counter] = {"plain": collections.Counter(), "spec": collections.Counter()}
    current = {"system": "plain"}
    calls: dict[str, collections.Counter] = {"plain": collections.Counter(), "spec": collections.Counter()}

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                seconds[current["system"]][label] += time.perf_counter() - started
                calls[current["system"]][label] += 1

        setattr(owner, name, wrapper)

    for name, label in (("run", "step"), ("_draft", "draft"), ("_verify", "verify"), ("_accept", "accept"),
                        ("_prefill", "prefill")):
        timed(StepExecutor, name, label)
    timed(type(target.model), "__call__", "model_call")
    timed(type(target.model), "output_logits", "output_logits")
    generate(target, prompts[0], SamplingParams(max_tokens=8))  # warm-up, not counted
    speculative_generate(target, prompts[0], SamplingParams(max_tokens=8), proposer, args.num_draft_tokens)
    for counter in (*seconds.values(), *calls.values()):
        counter.clear()
    tokens = collections.Counter()
    for ids in prompts:
        current["system"] = "plain"
        started = time.perf_counter()
        plain = generate(target, ids, params).token_ids
        seconds["plain"]["wall"] += time.perf_counter() - started
        tokens["plain"] += len(plain)
        current["system"] = "spec"
        started = time.perf_counter()
        result = speculative_generate(target, ids, params, proposer, args.num_draft_tokens)
        seconds["spec"]["wall"] += time.perf_counter() - started
        tokens["spec"] += len(result.token_ids)
        assert result.token_ids == plain, "speculative output differs from plain"
    for system, label in (("plain", "plain"), ("spec", args.draft)):
        parts = " ".join(f"{k}={v * 1e3 / tokens[system]:.3f}" for k, v in sorted(seconds[system].items()))
        print(f"{label}: {tokens[system]} tokens; ms per token: {parts}")
        steps = calls[system]["verify"]
        per_step = " ".join(f"{k}={v * 1e3 / steps:.3f}" for k, v in sorted(seconds[system].items())
                            if k not in ("wall", "prefill"))
        print(f"{label}: {steps} verifying steps, {tokens[system] / steps:.2f} tokens a step; ms per step: {per_step}")


if __name__ == "__main__":
    main()
