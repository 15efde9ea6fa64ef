"""Prefill of one prompt: the bare target pass against the serving engine's prefill path.

Three timings of an N-token prompt (random token ids, an empty KV cache), taking turns, median
of `repeats` each (wall and process CPU):
1. one target pass over all N tokens, logits at the last position only (the floor);
2. the passes the engine runs: chunks of `prefill_chunk` tokens, one pass each, written after
   the chunks before (the last computes the first token's logits);
3. the engine itself: a request submitted to a one-row engine (no prefix cache) until its
   final output (max_tokens 1) is out, so that the scheduler, the executor's per-chunk work and postprocessing count.

Usage:
    from eyas.bench.prefill import measure_prefill
    timing = measure_prefill(target, tokens=512, chunk=256)
    print(timing.describe())
    eyas bench costs --model smollm2-135m --dtype int4 --prefill 512
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from eyas.engine.target import Target


@dataclass
class PrefillTiming:
    tokens: int  # prompt length N
    chunk: int  # tokens per engine prefill pass
    one_pass_s: float  # one pass over N tokens
    chunked_s: float  # ceil(N / chunk) passes, as the engine runs them
    engine_s: float  # submit -> first token through a one-row engine
    cpu_s: tuple[float, ...] = ()  # the same three on the process CPU clock (every thread)

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.chunk < 1:
            raise ValueError(f"tokens and chunk must be >= 1, got {self.tokens} and {self.chunk}")

    @property
    def chunks(self) -> int:
        return -(-self.tokens // self.chunk)

    def describe(self) -> list[str]:
        rate = lambda seconds: self.tokens / seconds if seconds > 0 else float("inf")  # noqa: E731
        per_chunk = (self.engine_s - self.chunked_s) / self.chunks * 1e3
        cpu = ""
        if len(self.cpu_s) == 3:
            cpu = (f"; CPU (all threads) {self.cpu_s[0] * 1e3:.0f} / {self.cpu_s[1] * 1e3:.0f} / "
                   f"{self.cpu_s[2] * 1e3:.0f} ms, beyond the chunked passes "
                   f"{(self.cpu_s[2] - self.cpu_s[1]) / self.chunks * 1e3:+.2f} ms per chunk")
        return [
            f"prefill of {self.tokens} tokens (empty cache):",
            f"  one pass           {self.one_pass_s * 1e3:8.1f} ms  {rate(self.one_pass_s):8.0f} tokens/s",
            f"  {self.chunks} x {self.chunk}-token chunks {self.chunked_s * 1e3:6.1f} ms  "
            f"{rate(self.chunked_s):8.0f} tokens/s",
            f"  through the engine {self.engine_s * 1e3:8.1f} ms  {rate(self.engine_s):8.0f} tokens/s  "
            f"(beyond the chunked passes: {per_chunk:+.2f} ms per chunk)",
            f"  wall medians of {'interleaved'} runs{cpu}",
        ]


def _interleaved_medians(runs: list, repeats: int) -> tuple[list[float], list[float]]:
    """Median wall and process-CPU seconds (every thread) of each run, the runs taking turns
    so that noise on a shared machine hits them alike; each runs once first, untimed."""
    walls: list[list[float]] = [[] for _ in runs]
    cpus: list[list[float]] = [[] for _ in runs]
    for run in runs:
        run()  # first-call allocations
    for _ in range(repeats):
        for index, run in enumerate(runs):
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            walls[index].append(time.perf_counter() - wall)
            cpus[index].append(time.process_time() - cpu)
    return ([statistics.median(w) for w in walls], [statistics.median(c) for c in cpus])


@torch.inference_mode()
def measure_prefill(target: Target, tokens: int = 512, chunk: int = 256, repeats: int = 5,
                    seed: int = 0) -> PrefillTiming:
    from eyas.engine.generate import new_cache
    from eyas.engine.sampling import SamplingParams
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine

    generator = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    ids = torch.randint(0, vocab, (1, tokens), generator=generator).to(target.device)  # [1, N]
    cache = new_cache(target, 1, tokens + 1)

    def passes(size: int):
        def run() -> None:
            for start in range(0, tokens, size):
                end = min(start + size, tokens)
                target.model(ids[:, start:end], cache=cache, write_at=start, kv_len=end,
                             logits_at="last" if end == tokens else None, greedy=True)
        return run

    config = EngineConfig(max_running=1, prefill_chunk=chunk, max_step_tokens=max(chunk, 1),
                          prefix_caching=False, max_model_len=min(target.config.context_length,
                                                                  max(tokens + 2, 4096)))
    engine = Engine(target, config, draft="none")
    prompt = ids[0].tolist()
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def first_token() -> None:  # the loop runs on this thread, as in `eyas serve`
        done: list[bool] = []
        engine.submit(prompt, params, lambda output: done.append(output.finished))
        engine.run(stop_when=lambda: any(done))

    try:
        walls, cpus = _interleaved_medians([passes(tokens), passes(chunk), first_token], repeats)
    finally:
        engine.shutdown()
    return PrefillTiming(tokens, chunk, *walls, cpu_s=tuple(cpus))
