"""Load a target and decode a few tokens (greedy, or sampled at a temperature, seed 0); print
the time of each phase. Run it under /usr/bin/time -v for the peak resident memory of loading
(the first int4 load of a model quantizes it and writes the int4 cache; later ones map the
cache) and of decoding.

Usage:
    /usr/bin/time -v python scripts/load-footprint.py qwen2.5-coder-1.5b int4 8
    /usr/bin/time -v python scripts/load-footprint.py qwen2.5-coder-1.5b int4 48 0.7   # sampled
    /usr/bin/time -v python scripts/load-footprint.py model.Q4_K_M.gguf float32
"""

from __future__ import annotations

import sys
import time

started = time.perf_counter()
from eyas.engine.generate import SamplingParams, generate  # noqa: E402
from eyas.engine.target import load_target  # noqa: E402
from eyas.models.tokenizer import chat_prompt_ids  # noqa: E402

imported = time.perf_counter()
model, precision = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "auto"
tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 8
temperature = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
target = load_target(model, dtype=precision)
loaded = time.perf_counter()
ids = chat_prompt_ids(target.tokenizer, [{"role": "user", "content": "Write a Python function that reverses a string."}])
result = generate(target, ids, SamplingParams(max_tokens=tokens, temperature=temperature, seed=0))
done = time.perf_counter()
print(f"precision={target.precision} imports={imported - started:.2f}s load={loaded - imported:.2f}s "
      f"generate={done - loaded:.2f}s ({len(result.token_ids) / (done - loaded):.1f} tokens/s) "
      f"total={done - started:.2f}s")
print("tokens", result.token_ids)
