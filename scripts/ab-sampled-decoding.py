"""Plain sampled decoding with the Gumbel draw through the output layer's screen (engine/gumbel.py)
vs the full float32 output layer + softmax + inverse-CDF sampling, side by side in one process:
the two paths alternate prompt by prompt (greedy too, as a reference), tokens/s per request
(wall time, prefill included), medians and ratios. Also the sampler alone: one row's draw
through the screen vs full product + target_probs + sample_from, on real hidden states.

    python scripts/ab-sampled-decoding.py [NUM_PROMPTS] [MAX_TOKENS] [TEMPERATURES]
    python scripts/ab-sampled-decoding.py 8 64 0.7,1
"""
import statistics, sys, time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.bench.prompts import mtbench_first_turns
from eyas.engine import gumbel
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams, sample_from, target_probs
from eyas.engine.target import load_target
from eyas.models.tokenizer import chat_prompt_ids

num_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 8
max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 64
temperatures = [float(t) for t in (sys.argv[3] if len(sys.argv) > 3 else "0.7,1").split(",")]

target = load_target("smollm2-135m", dtype="int4")
prompts = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": q}])
           for q in mtbench_first_turns(num_prompts)]
screen_on = gumbel.available()
assert screen_on, "the extension's Gumbel sampler is not available here"


def rate(prompt, params, screen: bool) -> float:
    gumbel.available = (lambda: True) if screen else (lambda: False)
    started = time.perf_counter()
    out = generate(target, prompt, params)
    return len(out.token_ids) / (time.perf_counter() - started)


generate(target, prompts[0], SamplingParams(max_tokens=8))  # warm up
rows = {}
for prompt in prompts:
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows.setdefault("greedy", []).append(rate(prompt, greedy, True))
    for t in temperatures:
        params = SamplingParams(max_tokens=max_tokens, temperature=t, seed=0, ignore_eos=True)
        rows.setdefault(f"T={t} full product", []).append(rate(prompt, params, False))
        rows.setdefault(f"T={t} Gumbel screen", []).append(rate(prompt, params, True))
medians = {name: statistics.median(values) for name, values in rows.items()}
for name, value in medians.items():
    print(f"{name:24s} {value:7.1f} tok/s (median of {len(rows[name])})")
for t in temperatures:
    print(f"T={t}: screen / full = {medians[f'T={t} Gumbel screen'] / medians[f'T={t} full product']:.2f}, "
          f"screen / greedy = {medians[f'T={t} Gumbel screen'] / medians['greedy']:.2f}")

# The sampler alone, one row of a real hidden state (medians of alternated calls).
layer = target.model.lm_head
with torch.inference_mode():
    hidden = target.model(torch.tensor([prompts[0]]), logits_at=None).hidden[0, -1:].float()  # [1, H]
    scale = torch.tensor([gumbel.inverse_temperature(1.0)])
    times = {"full product + softmax + inverse CDF": [], "Gumbel screen": [], "greedy screen": []}
    generator = torch.Generator().manual_seed(0)
    for i in range(200):
        started = time.perf_counter()
        sample_from(target_probs(layer(hidden), SamplingParams(temperature=1.0)), generator)
        times["full product + softmax + inverse CDF"].append(time.perf_counter() - started)
        started = time.perf_counter()
        layer.sample_tokens(hidden, scale, torch.tensor([gumbel.noise_key(0, i)]))
        times["Gumbel screen"].append(time.perf_counter() - started)
        started = time.perf_counter()
        layer.greedy_logits(hidden).argmax(-1)
        times["greedy screen"].append(time.perf_counter() - started)
for name, values in times.items():
    print(f"one row, {name:36s} {statistics.median(values) * 1e3:6.3f} ms")
