"""Decode-pass time of int4 SmolLM2 with a float32 against a float64 KV cache, interleaved.

    python scripts/ab-kv-dtype.py [ROWS] [CONTEXT]      # default 1 row, 300 cached tokens

The int4 model's attention runs in float64 (models/llama.py); with a float32 cache every pass
converts each layer's whole cache. Both caches get the same prompt, then one-token passes
(greedy output layer) alternate between them; prints the median milliseconds of each.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from eyas.engine.target import load_target
from eyas.models.kv_cache import KVCache


def main(rows: int = 1, context: int = 300, repeats: int = 20, steps: int = 5) -> None:
    target = load_target("smollm2-135m", dtype="int4")
    model, config = target.model, target.config
    dtypes = (torch.float32, torch.float64)
    caches = {d: KVCache(config.num_hidden_layers, rows, config.num_key_value_heads,
                         context + steps, config.head_dim, dtype=d) for d in dtypes}
    times: dict[torch.dtype, list[float]] = {d: [] for d in dtypes}
    with torch.inference_mode():
        prompt = torch.randint(0, config.vocab_size, (rows, context))
        for cache in caches.values():
            model(prompt, cache=cache, write_at=0, logits_at=None)
        token = torch.randint(0, config.vocab_size, (rows, 1))
        for _ in range(repeats):
            for dtype, cache in caches.items():
                step_times = []
                for position in range(context, context + steps):
                    started = time.perf_counter()
                    model(token, cache=cache, write_at=position, logits_at="last", greedy=True)
                    step_times.append(time.perf_counter() - started)
                times[dtype].append(statistics.median(step_times))
    for dtype, values in times.items():
        print(f"rows {rows} context {context} cache {str(dtype).removeprefix('torch.')}: "
              f"{statistics.median(values) * 1000:.2f} ms per pass")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
