"""The never-slower policy with and without the stream's say on how a request starts, side by
side in one process: each prompt decoded plain, then by two proposers of the same method, one
under today's policy (a new request starts drafting where the stream's recent speculative
steps pay, eyas/engine/speculative/policy.py) and one under the rule before it (a fallback's
backoff always carried into the next request), in alternating order. Prints each one's median
and total speed-up over plain and its fallbacks; outputs are asserted equal to plain.

Usage:
    OMP_NUM_THREADS=2 PYTHONPATH=. python scripts/ab-policy-stream.py METHOD [PROMPTS] [DATASET]
    OMP_NUM_THREADS=2 PYTHONPATH=. python scripts/ab-policy-stream.py eagle3:smollm2-135m 24
    OMP_NUM_THREADS=2 PYTHONPATH=. python scripts/ab-policy-stream.py suffix 16 repeated
"""

from __future__ import annotations

import statistics
import sys
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)

from eyas.bench.prompts import load_prompt_set
from eyas.bench.repeated import repeated_prompts
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative import policy
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.methods import build_proposer
from eyas.engine.target import load_target
from eyas.models.tokenizer import chat_prompt_ids


class CarriedBackoff(policy.SpeculationPolicy):
    """The rule before: a new request clears its acceptance history, nothing else."""

    def begin_request(self) -> None:
        self.recent_tokens.clear()


def main() -> None:
    method = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    dataset = sys.argv[3] if len(sys.argv) > 3 else "mtbench"
    target = load_target("smollm2-135m", dtype="int4")
    if dataset == "repeated":
        conversations = [list(messages) for messages in repeated_prompts(count)]
    else:
        conversations = [[{"role": "user", "content": q}] for q in load_prompt_set(dataset, count)]
    prompts = [chat_prompt_ids(target.tokenizer, messages) for messages in conversations]
    params = SamplingParams(max_tokens=128)
    proposers = {"stream": build_proposer(method, target), "carried": build_proposer(method, target)}
    policy._SHARED[proposers["carried"]] = CarriedBackoff(policy.PolicyConfig())
    generate(target, prompts[0], SamplingParams(max_tokens=8))  # warm-up
    walls: dict[str, list[float]] = {"plain": [], "stream": [], "carried": []}
    for index, ids in enumerate(prompts):
        started = time.perf_counter()
        plain = generate(target, ids, params).token_ids
        walls["plain"].append(time.perf_counter() - started)
        for name in ("stream", "carried") if index % 2 else ("carried", "stream"):
            started = time.perf_counter()
            output = speculative_generate(target, ids, params, proposers[name], 4).token_ids
            walls[name].append(time.perf_counter() - started)
            assert output == plain, f"{name}: output differs from plain on prompt {index}"
    for name in ("stream", "carried"):
        ratios = [p / w for p, w in zip(walls["plain"], walls[name])]
        print(f"{method} ({name}): median {statistics.median(ratios):.3f}x plain, total "
              f"{sum(walls['plain']) / sum(walls[name]):.3f}x, fallbacks {policy._SHARED[proposers[name]].fallbacks}")


if __name__ == "__main__":
    main()
