"""Two int4 paths of the same target side by side, in one run.

    python scripts/ab-fused.py [DRAFT] [NUM_PROMPTS] [PAIR]
    python scripts/ab-fused.py eagle3:smollm2-135m+ngram 16 layers     # the default
    python scripts/ab-fused.py eagle3:smollm2-135m+ngram 16 kernel

PAIR "layers": the fused C++ layers (eyas/models/fused_cpu.py, float32 KV cache) against the
Python layers (float64 attention and cache). PAIR "kernel": the fused layers on eyas's int4 x
int8 kernel (models/csrc/int4_gemm.cpp; the implementation EYAS_INT4_KERNEL picks, the best by
default; EYAS_EXT_MARCH=haswell measures an AVX2-only build) against the same layers on
PyTorch's int4 kernel (EYAS_INT4_KERNEL=torch while that copy loads). Loads the int4 SmolLM2 target twice, one copy per path. Every
MT-Bench first turn is decoded four ways, plain and speculative (DRAFT, `--tree auto`, fallback
off) on each copy, the order alternating per prompt (greedy, 128 tokens). Prints median tok/s,
per-prompt ratios, tau, and how many speculative outputs are identical to their own path's
plain output (all of them, or eyas has a bug). The two paths may pick different tokens where
bf16 rounding of an activation differs; how many prompts agree token for token is printed too.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.methods import build_proposer
from eyas.engine.speculative.policy import PolicyConfig
from eyas.engine.target import load_target
from eyas.models import extension
from eyas.scheduler.measure import load_prompts


def load_pair(pair: str) -> dict:
    """{name: target}, the baseline first."""
    if pair == "layers":
        targets = {"python": load_target("smollm2-135m"), "fused": load_target("smollm2-135m")}
        targets["python"].model.fused_plan = False  # the Python layers
        assert [t.kv_dtype for t in targets.values()] == [torch.float64, torch.float32]
    elif pair == "kernel":
        choice = os.environ.get("EYAS_INT4_KERNEL")
        os.environ["EYAS_INT4_KERNEL"] = "torch"  # Int4Linear picks its layout when the target loads
        targets = {"pytorch-int4": load_target("smollm2-135m")}
        os.environ.pop("EYAS_INT4_KERNEL")
        if choice:
            os.environ["EYAS_INT4_KERNEL"] = choice
        kernel = extension.int8dot_kernel()
        targets[f"int8dot-{kernel}"] = load_target("smollm2-135m")
        layouts = [t.model.layers[0].mlp.down_proj.layout for t in targets.values()]
        assert layouts == ["torch", "int8dot"], f"no int8dot kernel on this machine: {layouts}"
    else:
        raise SystemExit(f"PAIR must be layers or kernel, not {pair!r}")
    assert list(targets.values())[-1].model.fused_layers() is not None, "the fused layer did not build"
    return targets


def main(draft: str = "eagle3:smollm2-135m+ngram", num_prompts: int = 16, pair: str = "layers") -> None:
    targets = load_pair(pair)
    base, new = targets
    prompts = load_prompts(targets[new], "mtbench", num_prompts)
    params, off = SamplingParams(max_tokens=128), PolicyConfig(enabled=False)
    proposers = {name: build_proposer(draft, target, "auto") for name, target in targets.items()}
    for name, target in targets.items():  # warm-up
        generate(target, prompts[0], params)
        speculative_generate(target, prompts[0], params, proposers[name], policy=off)
    runs = [(f"{name} {kind}", name, kind) for name in targets for kind in ("plain", "speculative")]
    rates: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    taus: dict[str, list[float]] = {name: [] for name in targets}
    identical = {name: 0 for name in targets}
    paths_agree = 0
    for index, prompt in enumerate(prompts):
        outputs = {}
        for label, name, kind in runs if index % 2 == 0 else reversed(runs):
            started = time.perf_counter()
            if kind == "plain":
                result = generate(targets[name], prompt, params)
            else:
                result = speculative_generate(targets[name], prompt, params, proposers[name], policy=off)
                taus[name].append(result.stats["speculative"]["acceptance_length"])
            rates[label].append(len(result.token_ids) / (time.perf_counter() - started))
            outputs[label] = result.token_ids
        for name in targets:
            identical[name] += outputs[f"{name} plain"] == outputs[f"{name} speculative"]
        paths_agree += outputs[f"{base} plain"] == outputs[f"{new} plain"]
    print(f"{draft}, {len(prompts)} MT-Bench prompts, int4 target, 128 tokens, greedy")
    for label, values in rates.items():
        name = label.split()[0]
        ratio = statistics.median(v / p for v, p in zip(values, rates[f"{name} plain"]))
        tau = f", tau mean {statistics.mean(taus[name]):.2f}" if label.endswith("speculative") else ""
        print(f"{label}: median {statistics.median(values):.1f} tok/s, {ratio:.3f}x its plain{tau}")
    for kind in ("plain", "speculative"):
        gain = statistics.median(f / p for f, p in zip(rates[f"{new} {kind}"], rates[f"{base} {kind}"]))
        print(f"{new} / {base}, {kind}, median per prompt: {gain:.3f}x")
    print(f"speculative identical to plain: {base} {identical[base]}/{len(prompts)}, "
          f"{new} {identical[new]}/{len(prompts)}; the two paths' plain outputs agree on "
          f"{paths_agree}/{len(prompts)} prompts")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(*(sys.argv[1:2]), *(int(a) for a in sys.argv[2:3]), *(sys.argv[3:4]))
