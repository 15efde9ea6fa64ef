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
import sys

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.bench.agreement import Agreement
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import load_target
from eyas.models import extension
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
    agreement = Agreement(reference, paths)
    for prompt in prompts:
        agreement.add(prompt, generate(reference, prompt, SamplingParams(max_tokens=128)).token_ids)
    print(f"{len(prompts)} MT-Bench prompts, {agreement.positions} answer positions of the float32 model")
    for name in paths:
        print(f"int4 {name}: top-1 agreement with float32 {agreement.top1(name):.4f}, "
              f"mean KL(float32 || int4) {agreement.mean_kl(name):.3e}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(*(int(a) for a in sys.argv[1:2]))
