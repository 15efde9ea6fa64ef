"""A/B of the greedy output layer: the int8-screened layer against a plain float32 product.

Usage:
    .venv/bin/python scripts/ab-output-layer.py

Decodes 8 MT-Bench first turns (128 tokens, greedy, int4 target) with each output layer,
alternating which goes first per prompt, and prints the median tokens/s of each, their ratio
and how many outputs are identical (old BENCHMARKS.md section 1).
"""

import statistics

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.bench.prompts import mtbench_first_turns
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import load_target
from eyas.models.tokenizer import chat_prompt_ids


class PlainOutputLayer(torch.nn.Module):
    """logits = x @ W^T in float32, nothing screened."""

    def __init__(self, weight_t: torch.Tensor) -> None:  # [H, V]
        super().__init__()
        self.weight_t = weight_t

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        return x @ self.weight_t


def main() -> None:
    torch.set_num_threads(2)
    target = load_target("smollm2-135m", dtype="int4")
    screened = target.model.lm_head
    layers = {"screened": screened, "float32": PlainOutputLayer(screened.weight_t)}
    params = SamplingParams(max_tokens=128)
    rates: dict[str, list[float]] = {name: [] for name in layers}
    same = 0
    for index, text in enumerate(mtbench_first_turns(8)):
        ids = chat_prompt_ids(target.tokenizer, [{"role": "user", "content": text}])
        order = list(layers) if index % 2 == 0 else list(reversed(layers))
        outputs = {}
        for name in order:
            target.model.lm_head = layers[name]
            result = generate(target, ids, params)
            rates[name].append(result.stats["tokens_per_s"])
            outputs[name] = result.token_ids
        same += outputs["screened"] == outputs["float32"]
    target.model.lm_head = screened
    for name, values in rates.items():
        print(name, "median tok/s", round(statistics.median(values), 1), [round(v, 1) for v in values])
    ratio = statistics.median(rates["screened"]) / statistics.median(rates["float32"])
    print("ratio of medians", round(ratio, 3), "identical", same, "/ 8")


if __name__ == "__main__":
    main()
