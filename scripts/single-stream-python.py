"""The time a single-stream plain decode spends outside its two C++ calls (the fused decoder
stack and the output screen): the wall clock of greedy decoding over MT-Bench first turns less
the time inside those calls, per token; TEMPERATURE > 0 samples (seeded), drawing each token
through the screen. Run it from two code trees in turn to compare them.

Usage:
    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/single-stream-python.py [PROMPTS] [TOKENS] [TEMPERATURE]
    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/single-stream-python.py 16 128
"""

from __future__ import annotations

import sys
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)

from eyas.bench.prompts import load_prompt_set
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import load_target
from eyas.models import fused_cpu
from eyas.models.output_layer import ScreenedOutputLayer
from eyas.models.tokenizer import chat_prompt_ids


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    target = load_target("smollm2-135m", dtype="int4")
    prompts = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": q}])
               for q in load_prompt_set("mtbench", count)]
    inside = {"stack": 0.0, "screen": 0.0}
    depth = {"stack": 0, "screen": 0}  # a call inside another of its part counts once

    def timed(owner, name: str, part: str) -> None:
        original = getattr(owner, name, None)
        if original is None:  # a code tree without this call
            return

        def wrapper(*args, **kwargs):
            depth[part] += 1
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                depth[part] -= 1
                if not depth[part]:
                    inside[part] += time.perf_counter() - started

        setattr(owner, name, wrapper)

    for name in ("run", "decode"):
        timed(fused_cpu.FusedStack, name, "stack")
    for name in ("greedy_logits", "greedy_tokens", "sample_tokens", "sample_token_ids"):
        timed(ScreenedOutputLayer, name, "screen")
    params = SamplingParams(max_tokens=tokens, temperature=temperature, seed=0 if temperature else None)
    generate(target, prompts[0], SamplingParams(max_tokens=8))  # warm-up
    inside.update(stack=0.0, screen=0.0)
    started, emitted = time.perf_counter(), 0
    for ids in prompts:
        emitted += len(generate(target, ids, params).token_ids)
    wall = time.perf_counter() - started
    per = lambda seconds: seconds / emitted * 1e3  # noqa: E731
    print(f"{emitted} tokens: {per(wall):.3f} ms a token, of which the decoder stack {per(inside['stack']):.3f} "
          f"(prefill included), the output screen {per(inside['screen']):.3f}, "
          f"outside them {per(wall - inside['stack'] - inside['screen']):.3f}")


if __name__ == "__main__":
    main()
