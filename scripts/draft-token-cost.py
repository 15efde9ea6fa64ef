"""What one greedy token of a draft model costs through its two paths: the generic forward
(`Transformer.forward`, the vocabulary subset's logits, an argmax in PyTorch) and the
single-stream call (`Transformer.decode_rows`, the subset screen's argmax as a Python int), on
two caches fed the same tokens; each path's own next token is fed back and the two are asserted
equal at every step. Medians of wall clock per token.

Usage:
    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/draft-token-cost.py [MODEL] [TOKENS]
    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/draft-token-cost.py qwen2.5-coder-0.5b 40
"""

from __future__ import annotations

import statistics
import sys
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.engine.speculative.proposers.draft_vocabulary import DraftVocabulary
from eyas.engine.target import load_target
from eyas.models.kv_cache import LayerSubsetKVCache


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    draft = load_target(name, dtype="int4")
    config, model = draft.config, draft.model
    vocabulary = DraftVocabulary.build(draft)  # None for a small vocabulary: the whole screen

    def new_cache() -> LayerSubsetKVCache:
        return LayerSubsetKVCache(list(range(config.num_hidden_layers)), 1, config.num_key_value_heads,
                                  tokens + 64, config.head_dim, dtype=draft.kv_dtype, device=draft.device)

    def mapped(index: int) -> int:
        return vocabulary.token(index) if vocabulary is not None else index

    prompt = list(range(1000, 1040))
    seconds: dict[str, list[float]] = {"generic forward": [], "decode_rows": []}
    with torch.inference_mode():
        caches = {path: new_cache() for path in seconds}
        for cache in caches.values():
            model(torch.tensor([prompt]), cache=cache, logits_at=None)
        token = dict.fromkeys(seconds, 1500)
        for step in range(tokens):
            position = len(prompt) + step
            for path in seconds:
                started = time.perf_counter()
                if path == "generic forward":
                    out = model(torch.tensor([[token[path]]]), cache=caches[path], write_at=position,
                                logits_at=None, greedy=True)
                    hidden = out.hidden[:, -1]
                    logits = vocabulary.logits(hidden) if vocabulary is not None else model.output_logits(hidden, True)
                    token[path] = mapped(int(logits.argmax(dim=-1)))
                else:
                    out = model.decode_one(token[path], position, caches[path])
                    layer = vocabulary.layer if vocabulary is not None else model
                    token[path] = mapped(layer.greedy_tokens(out.hidden)[0])
                seconds[path].append(time.perf_counter() - started)
            assert len(set(token.values())) == 1, f"the paths disagree at step {step}: {token}"
    for path, values in seconds.items():
        print(f"{name} int4, {path}: median {statistics.median(values) * 1e3:.2f} ms a token ({tokens} tokens)")


if __name__ == "__main__":
    main()
