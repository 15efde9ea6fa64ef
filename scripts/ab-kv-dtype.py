"""The int4 target with a float32 against a float16 KV cache, alternated in one process.

    python scripts/ab-kv-dtype.py step [ROWS] [CONTEXT] [ROUNDS]   # default 1 row, 256 cached, 15 rounds
    python scripts/ab-kv-dtype.py batch [ROWS] [MAX_TOKENS] [ROUNDS]  # default 16 prompts, 128 tokens, 3

step: ROWS cache rows each hold CONTEXT cached tokens; one-token greedy passes over all rows
(a dense decode pass of ROWS sequences) alternate between the two caches, 5 passes per cache
and round. Prints the median wall and process-CPU milliseconds per pass of each cache and the
ratio float32 / float16 (CPU time is the steadier figure on a shared machine; it counts every
thread).

batch: `generate_batch` (the serving engine's continuous batching) over ROWS MT-Bench prompts,
greedy, MAX_TOKENS each, alternating the cache by round; prints tokens/s (wall) and tokens per
process-CPU-second of each, and the ratios.
Set the threads with OMP_NUM_THREADS.
"""

from __future__ import annotations

import statistics
import sys
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.engine.generate import generate_batch
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import load_target
from eyas.models.kv_cache import KVCache
from eyas.scheduler.measure import load_prompts

CHOICES = ("float32", "float16")


def step(target, rows: int = 1, context: int = 256, rounds: int = 15, passes: int = 5) -> None:
    model, config = target.model, target.config
    caches = {}
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, config.vocab_size, (rows, context), generator=generator)  # [B, context]
    token = torch.randint(3, config.vocab_size, (rows, 1), generator=generator)  # [B, 1]
    with torch.inference_mode():
        for kv in CHOICES:
            model.kv_dtype_choice = kv
            caches[kv] = KVCache(config.num_hidden_layers, rows, config.num_key_value_heads, context + passes,
                                 config.head_dim, dtype=target.kv_dtype)
            model(prompt, cache=caches[kv], write_at=0, logits_at=None)
        wall: dict[str, list[float]] = {kv: [] for kv in CHOICES}
        cpu: dict[str, list[float]] = {kv: [] for kv in CHOICES}
        for _ in range(rounds):
            for kv in CHOICES:
                for position in range(context, context + passes):
                    started, started_cpu = time.perf_counter(), time.process_time()
                    model(token, cache=caches[kv], write_at=position, logits_at="last", greedy=True)
                    wall[kv].append(time.perf_counter() - started)
                    cpu[kv].append(time.process_time() - started_cpu)
    per_token = caches["float32"].keys[:, 0, :, 0].numel() * 2
    print(f"rows {rows}, context {context}, {torch.get_num_threads()} thread(s), {rounds} rounds x {passes} passes; "
          f"KV per token {per_token * 4 / 1024:.1f} KiB float32, {per_token * 2 / 1024:.1f} KiB float16")
    for kv in CHOICES:
        print(f"  cache {kv}: {statistics.median(wall[kv]) * 1000:.3f} ms wall, "
              f"{statistics.median(cpu[kv]) * 1000:.3f} ms CPU per pass")
    print(f"  float32 / float16: {statistics.median(wall['float32']) / statistics.median(wall['float16']):.3f}x wall, "
          f"{statistics.median(cpu['float32']) / statistics.median(cpu['float16']):.3f}x CPU")


def batch(target, rows: int = 16, max_tokens: int = 128, rounds: int = 3) -> None:
    prompts = load_prompts(target, "mtbench", rows)
    params = SamplingParams(max_tokens=max_tokens)
    rates: dict[str, list[float]] = {kv: [] for kv in CHOICES}
    cpu_rates: dict[str, list[float]] = {kv: [] for kv in CHOICES}
    for _ in range(rounds):
        for kv in CHOICES:
            target.model.kv_dtype_choice = kv
            started, started_cpu = time.perf_counter(), time.process_time()
            results = generate_batch(target, prompts, params)
            tokens = sum(len(r.token_ids) for r in results)
            rates[kv].append(tokens / (time.perf_counter() - started))
            cpu_rates[kv].append(tokens / (time.process_time() - started_cpu))
    print(f"generate_batch, {rows} MT-Bench prompts x {max_tokens} tokens, {torch.get_num_threads()} thread(s), "
          f"{rounds} rounds")
    for kv in CHOICES:
        print(f"  cache {kv}: {statistics.median(rates[kv]):.1f} tok/s (runs {', '.join(f'{r:.1f}' for r in rates[kv])}), "
              f"{statistics.median(cpu_rates[kv]):.1f} tokens per CPU-second")
    print(f"  float16 / float32: {statistics.median(rates['float16']) / statistics.median(rates['float32']):.3f}x wall, "
          f"{statistics.median(cpu_rates['float16']) / statistics.median(cpu_rates['float32']):.3f}x CPU")


def main(argv: list[str]) -> None:
    mode = argv[0] if argv else "step"
    numbers = [int(a) for a in argv[1:]]
    target = load_target("smollm2-135m", dtype="int4")
    if mode == "step":
        step(target, *numbers)
    elif mode == "batch":
        batch(target, *numbers)
    else:
        raise SystemExit(f"unknown mode {mode!r}: step or batch")


if __name__ == "__main__":
    main(sys.argv[1:])
