"""How closely int4 and int8 follow the float32 model of the same source, and what each costs:
top-1 agreement, KL and decoding speed, side by side in one process.

    OMP_NUM_THREADS=1 python scripts/int8-agreement.py MODEL [NUM_PROMPTS] [TOKENS]

MODEL: an alias or a .gguf (scripts/requantize-gguf.py writes a Q8_0 copy of one). For every
MT-Bench first turn (default 8), the float32 model answers greedily (TOKENS, default 64); each
precision then reads prompt + answer in one pass (teacher forcing) and is compared with float32
at every answer position: the share of positions whose argmax agrees, and the mean
KL(float32 || precision). Speed: each precision decodes every prompt greedily (TOKENS), the
precisions interleaved prompt by prompt; the median of the prompts' decoding tokens/s.
"""

from __future__ import annotations

import statistics
import sys

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.bench.agreement import Agreement
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import load_target
from eyas.scheduler.measure import load_prompts

PRECISIONS = ("float32", "int4", "int8")


def main(model: str, num_prompts: int = 8, tokens: int = 64) -> None:
    targets = {name: load_target(model, dtype=name) for name in PRECISIONS}
    reference = targets["float32"]
    prompts = load_prompts(reference, "mtbench", num_prompts)
    params = SamplingParams(max_tokens=tokens)
    agreement = Agreement(reference, targets)
    speed: dict[str, list[float]] = {name: [] for name in PRECISIONS}
    same: dict[str, int] = {name: 0 for name in PRECISIONS}
    for prompt in prompts:
        answers = {}
        for name, target in targets.items():  # 1. decoding, interleaved
            result = generate(target, prompt, params)
            answers[name] = result.token_ids
            speed[name].append(result.stats["tokens_per_s"])
        for name in PRECISIONS:
            same[name] += int(answers[name] == answers["float32"])
        agreement.add(prompt, answers["float32"])  # 2. teacher forcing on the float32 answer
    print(f"{model}: {len(prompts)} MT-Bench prompts, {agreement.positions} answer positions of the "
          f"float32 model, {torch.get_num_threads()} thread(s)")
    base = statistics.median(speed["float32"])
    for name in PRECISIONS:
        tps = statistics.median(speed[name])
        print(f"{name:8s} top-1 agreement {agreement.top1(name):.4f}  KL {agreement.mean_kl(name):.2e}  "
              f"answers equal to float32 {same[name]}/{len(prompts)}  decoding {tps:.1f} tok/s "
              f"({tps / base:.2f}x float32)")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], *(int(a) for a in sys.argv[2:4]))
