"""How closely the int4 target with a float16 KV cache follows the same target with a float32 one.

    python scripts/kv-dtype-agreement.py [NUM_PROMPTS] [GREEDY_PROMPTS] [MAX_TOKENS]
    # default 40 MT-Bench first turns teacher-forced, 16 decoded greedily, 128 tokens

1. Teacher forcing: for every prompt, the float32-cache target answers greedily; then the target
   reads prompt + answer in one pass with each cache (the pass writes its keys and values and
   attends over them, so the float16 rounding is in every row) and the share of answer
   positions whose argmax agrees is printed, with the mean KL(float32 cache || float16 cache).
2. Greedy decoding: the first GREEDY_PROMPTS prompts answered with each cache; how many answers
   are identical, and where the others part.
"""

from __future__ import annotations

import statistics
import sys

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch
import torch.nn.functional as F

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import load_target
from eyas.models.kv_cache import KVCache
from eyas.scheduler.measure import load_prompts

CHOICES = ("float32", "float16")


def forced_logits(target, ids: torch.Tensor, kv: str) -> torch.Tensor:
    """Logits [P + A, V] of one pass over ids [1, P + A] with a fresh cache of dtype `kv`."""
    config = target.config
    target.model.kv_dtype_choice = kv
    cache = KVCache(config.num_hidden_layers, 1, config.num_key_value_heads, ids.shape[1], config.head_dim,
                    dtype=target.kv_dtype)
    return target.model(ids, cache=cache, write_at=0).logits[0].float()


def main(num_prompts: int = 40, greedy_prompts: int = 16, max_tokens: int = 128) -> None:
    target = load_target("smollm2-135m", dtype="int4")
    prompts = load_prompts(target, "mtbench", max(num_prompts, greedy_prompts))
    params = SamplingParams(max_tokens=max_tokens)
    agree = positions = 0
    divergence: list[float] = []
    answers: dict[str, list[list[int]]] = {kv: [] for kv in CHOICES}
    with torch.inference_mode():
        for index, prompt in enumerate(prompts):
            # 1. the float32-cache answer, and the float16-cache one for the greedy comparison
            for kv in CHOICES if index < greedy_prompts else CHOICES[:1]:
                target.model.kv_dtype_choice = kv
                answers[kv].append(generate(target, prompt, params).token_ids)
            if index >= num_prompts:
                continue
            # 2. teacher forcing on the float32-cache answer
            answer = answers["float32"][index]
            ids = torch.tensor([list(prompt) + list(answer)])  # [1, P + A]
            start = len(prompt) - 1
            reference = forced_logits(target, ids, "float32")[start:-1]  # [A, V]
            half = forced_logits(target, ids, "float16")[start:-1]  # [A, V]
            agree += int((half.argmax(-1) == reference.argmax(-1)).sum())
            positions += len(answer)
            divergence.append(F.kl_div(half.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                       reduction="batchmean").item())
    print(f"{min(num_prompts, len(prompts))} MT-Bench prompts, {positions} answer positions of the "
          f"float32-cache target (teacher forcing)")
    print(f"float16 cache: top-1 agreement with the float32 cache {agree / max(positions, 1):.4f} "
          f"({agree} / {positions}), mean KL(float32 || float16) {statistics.mean(divergence):.3e}")
    same, parts = 0, []
    for a, b in zip(answers["float32"], answers["float16"]):
        if a == b:
            same += 1
        else:
            parts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    print(f"greedy, {len(answers['float16'])} prompts x {max_tokens} tokens: {same} answers identical; "
          f"the others part at tokens {sorted(parts)}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*(int(a) for a in sys.argv[1:4]))
