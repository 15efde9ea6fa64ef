"""How closely each int4 path follows the float32 model: Python layers, fused C++ layers on
PyTorch's int4 kernel, and fused layers on eyas's int4 x int8 kernel (AVX512-VNNI or AVX2).

    python scripts/int4-agreement.py [NUM_PROMPTS]      # default 40 MT-Bench first turns

For every prompt, the float32 SmolLM2 target answers greedily (128 tokens); then each int4 path
reads prompt + that answer in one pass (teacher forcing) and is compared with float32 at every
answer position: the share of positions whose argmax agrees, and the mean KL(float32 || int4)
per position. No int4 path is the reference: the first two round activations to bf16 for the
int4 matmuls, eyas's kernel to 14-bit integers per 32 inputs (BENCHMARKS.md, "Kernels and
precisions").
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn.functional as F

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import load_target
from eyas.models import extension
from eyas.models.kv_cache import KVCache
from eyas.scheduler.measure import load_prompts


def main(num_prompts: int = 40) -> None:
    reference = load_target("smollm2-135m", dtype="float32")
    os.environ["EYAS_INT4_KERNEL"] = "torch"  # Int4Linear picks its layout when the target is loaded
    paths = {"python layers": load_target("smollm2-135m"), "fused layers": load_target("smollm2-135m")}
    paths["python layers"].model.fused_plan = False
    os.environ.pop("EYAS_INT4_KERNEL")
    if extension.int8dot_kernel():
        paths[f"fused layers, int8dot kernel ({extension.int8dot_kernel()})"] = load_target("smollm2-135m")
    prompts = load_prompts(reference, "mtbench", num_prompts)
    agree = {name: 0 for name in paths}
    divergence: dict[str, list[float]] = {name: [] for name in paths}
    positions = 0
    for prompt in prompts:
        answer = generate(reference, prompt, SamplingParams(max_tokens=128)).token_ids
        ids = torch.tensor([list(prompt) + list(answer)])
        start = len(prompt) - 1  # the row that predicts the first answer token
        with torch.inference_mode():
            expected = reference.model(ids).logits[0, start:-1].float()  # [A, V]
            for name, target in paths.items():
                config = target.config
                cache = KVCache(config.num_hidden_layers, 1, config.num_key_value_heads, ids.shape[1],
                                config.head_dim, dtype=target.kv_dtype)
                logits = target.model(ids, cache=cache, write_at=0).logits[0, start:-1].float()
                agree[name] += int((logits.argmax(-1) == expected.argmax(-1)).sum())
                divergence[name].append(F.kl_div(logits.log_softmax(-1), expected.log_softmax(-1),
                                                 log_target=True, reduction="batchmean").item())
        positions += len(answer)
    print(f"{len(prompts)} MT-Bench prompts, {positions} answer positions of the float32 model")
    for name in paths:
        print(f"int4 {name}: top-1 agreement with float32 {agree[name] / positions:.4f}, "
              f"mean KL(float32 || int4) {statistics.mean(divergence[name]):.3e}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(*(int(a) for a in sys.argv[1:2]))
