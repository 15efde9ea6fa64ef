"""An EAGLE-3 head beside the int4 target: float32 linears against int4 linears, in one run.

    python scripts/ab-head-precision.py [DRAFT] [NUM_PROMPTS]
    python scripts/ab-head-precision.py eagle3:smollm2-135m+ngram 40     # the default

Beside an int4 target, `--draft eagle3:...` now quantizes the head's linear layers to int4
(eyas/engine/speculative/methods.py). This builds the same draft twice, once with that step
left out (float32 head, as before), and decodes every MT-Bench first turn plain, with the
float32 head and with the int4 head, alternating the order per prompt (greedy, 128 tokens,
`--tree auto`, fallback off). Prints median tok/s, tau, per-prompt speed ratios, and how many
outputs are identical to plain decoding (all of them, or eyas has a bug).
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import contextmanager

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

import eyas.models.quant as quant
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.methods import build_proposer
from eyas.engine.speculative.policy import PolicyConfig
from eyas.engine.target import load_target
from eyas.scheduler.measure import load_prompts


@contextmanager
def float_head():
    """build_proposer without the int4 step (methods.py imports quantize_linears per call)."""
    saved = quant.quantize_linears
    quant.quantize_linears = lambda module, group_size=32: module
    try:
        yield
    finally:
        quant.quantize_linears = saved


def head_of(proposer):
    return getattr(proposer, "main", proposer).head


def main(draft: str = "eagle3:smollm2-135m+ngram", num_prompts: int = 40) -> None:
    target = load_target("smollm2-135m")
    prompts = load_prompts(target, "mtbench", num_prompts)
    with float_head():
        proposers = {"float32 head": build_proposer(draft, target, "auto")}
    proposers["int4 head"] = build_proposer(draft, target, "auto")
    assert [head_of(p).precision for p in proposers.values()] == ["float32", "int4"]
    params, off = SamplingParams(max_tokens=128), PolicyConfig(enabled=False)
    for proposer in proposers.values():  # warm-up
        speculative_generate(target, prompts[0], params, proposer, policy=off)
    rates: dict[str, list[float]] = {"plain": [], **{name: [] for name in proposers}}
    taus: dict[str, list[float]] = {name: [] for name in proposers}
    identical = 0
    for index, prompt in enumerate(prompts):
        runs = [("plain", None), *proposers.items()]
        outputs = {}
        for name, proposer in runs if index % 2 == 0 else reversed(runs):
            started = time.perf_counter()
            if proposer is None:
                result = generate(target, prompt, params)
            else:
                result = speculative_generate(target, prompt, params, proposer, policy=off)
                taus[name].append(result.stats["speculative"]["acceptance_length"])
            rates[name].append(len(result.token_ids) / (time.perf_counter() - started))
            outputs[name] = result.token_ids
        identical += len({tuple(ids) for ids in outputs.values()}) == 1
    print(f"{draft}, {len(prompts)} MT-Bench prompts, int4 target, 128 tokens, greedy")
    for name, values in rates.items():
        tau = f", tau median {statistics.median(taus[name]):.2f} mean {statistics.mean(taus[name]):.2f}" \
            if name in taus else ""
        ratio = statistics.median(v / p for v, p in zip(values, rates["plain"]))
        print(f"{name}: median {statistics.median(values):.1f} tok/s, {ratio:.3f}x plain{tau}")
    gain = statistics.median(a / b for a, b in zip(rates["int4 head"], rates["float32 head"]))
    print(f"int4 head / float32 head, median per prompt: {gain:.3f}x; identical to plain "
          f"{identical}/{len(prompts)}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(*(sys.argv[1:2]), *(int(a) for a in sys.argv[2:3]))
