"""Where `eyas bench offline`'s time goes, eyas int4 against llama.cpp on the same GGUF: prompt
prefill (tokens/s) and decoding (ms per token), measured apart, side by side in one process.

    python scripts/prefill-decode-split.py [MODEL] [DATASET] [NUM_PROMPTS] [THREADS] [ROUNDS]
    python scripts/prefill-decode-split.py qwen2.5-coder-1.5b code 6 1 3    # the default

The prompts are those of `eyas bench offline` (chat template applied). For each prompt and
system, the two runs alternate: a 1-token generation (prefill + the first token, which the
prefill's logits give) and a 64-token one (EOS ignored); prefill = the first, decoding = (the
second - the first) / 63. llama.cpp's KV cache is emptied before each run (llama-cpp-python
would otherwise keep the previous prompt's common prefix, which `bench offline`'s llama.cpp
runner profits from: the shared chat-template prefix is reported). Times on the process's CPU
clock with one thread (a loaded machine does not inflate it), on the wall clock otherwise.
Prints medians over prompts and rounds, and the load average.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

DECODE_TOKENS = 64


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
    dataset = sys.argv[2] if len(sys.argv) > 2 else "code"
    num_prompts = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter

    from llama_cpp import Llama

    from eyas.bench.peers import gguf_path
    from eyas.bench.prompts import load_prompt_set
    from eyas.engine.generate import SamplingParams, generate
    from eyas.engine.target import load_target
    from eyas.models.registry import resolve_model
    from eyas.models.tokenizer import chat_prompt_ids, load_tokenizer

    tokenizer = load_tokenizer(str(resolve_model(model)))
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}])
               for q in load_prompt_set(dataset, num_prompts)]
    shared = min(next((i for i, (a, b) in enumerate(zip(p, prompts[0])) if a != b), len(p)) for p in prompts[1:])
    print(f"{model} {dataset}: {len(prompts)} prompts, {statistics.median(len(p) for p in prompts)} tokens "
          f"(median), {shared} shared by all (chat template); threads {threads}, "
          f"{'CPU' if threads == 1 else 'wall'} clock; load average {os.getloadavg()}", flush=True)

    target = load_target(model, dtype="int4")
    llm = Llama(model_path=str(gguf_path(model)), n_threads=threads, n_threads_batch=threads, n_ctx=4096,
                verbose=False)

    def eyas_run(ids: list[int], count: int) -> int:
        return len(generate(target, ids, SamplingParams(max_tokens=count, ignore_eos=True)).token_ids)

    def llama_run(ids: list[int], count: int) -> int:
        llm.reset()  # no prefix kept from the run before
        out = 0
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out += 1
            if out >= count:
                break
        return out

    systems = {"eyas int4": eyas_run, "llama.cpp": llama_run}
    for run in systems.values():  # warm-up
        run(prompts[0], 4)
    prefill: dict[str, list[float]] = {name: [] for name in systems}  # tokens/s
    decode: dict[str, list[float]] = {name: [] for name in systems}  # ms per token
    for round_index in range(rounds):
        for index, ids in enumerate(prompts):
            order = list(systems) if (round_index + index) % 2 == 0 else list(systems)[::-1]
            for name in order:
                started = clock()
                first = systems[name](ids, 1)
                one = clock() - started
                started = clock()
                count = systems[name](ids, DECODE_TOKENS)
                whole = clock() - started
                assert first == 1 and count == DECODE_TOKENS, (name, first, count)
                prefill[name].append(len(ids) / one)
                decode[name].append(1e3 * (whole - one) / (DECODE_TOKENS - 1))
    for name in systems:
        print(f"{name:10s} prefill {statistics.median(prefill[name]):7.1f} tok/s   "
              f"decode {statistics.median(decode[name]):6.2f} ms/token", flush=True)
    eyas_name, llama_name = systems
    print(f"eyas / llama.cpp: prefill {statistics.median(prefill[eyas_name]) / statistics.median(prefill[llama_name]):.2f}x, "
          f"decode {statistics.median(decode[llama_name]) / statistics.median(decode[eyas_name]):.2f}x "
          f"(speed ratios); load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
