"""Decode-pass time of int4 SmolLM2: one ragged pass against the same step padded to [B, T].

    python scripts/ab-ragged-pass.py [SEQUENCES] [DRAFTING] [DRAFT_TOKENS] [CONTEXT]
    # default: 16 sequences, 3 of them drafting a chain of 8 tokens, ~200 cached tokens each

The step: SEQUENCES requests decoding, DRAFTING of them (spread over the rows) verifying
DRAFT_TOKENS draft tokens, the others plain. Padded, the pass is SEQUENCES x (1 + DRAFT_TOKENS)
rows (batch.py build_decode_batch); split, one dense pass per run of neighbouring rows of one
length (no padding, several passes); ragged, one pass of SEQUENCES + DRAFTING x DRAFT_TOKENS
rows (build_ragged_batch). The plain step (SEQUENCES rows of one token) runs too, as the
reference. They alternate,
each timed on the process's CPU clock and on the wall clock (the output layer included, as
the serving step runs it); prints the medians in milliseconds.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import replace

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.engine.generate import new_cache
from eyas.engine.speculative.draft import DraftTree
from eyas.engine.target import load_target
from eyas.scheduler.batch import RowInput, build_decode_batch, build_ragged_batch


def main(sequences: int = 16, drafting: int = 3, draft_tokens: int = 8, context: int = 200,
         repeats: int = 15) -> None:
    target = load_target("smollm2-135m", dtype="int4")
    model, vocab = target.model, target.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    contexts = [context - 20 + (11 * row) % 41 for row in range(sequences)]  # each its own length
    cache = new_cache(target, sequences, max(contexts) + draft_tokens + 2)
    drafted = set(range(0, sequences, max(sequences // max(drafting, 1), 1))[:drafting])  # spread out
    inputs = []
    with torch.inference_mode():
        for row, length in enumerate(contexts):
            view = new_cache(target, 1, cache.max_slots)
            model(torch.randint(0, vocab, (1, length), generator=generator), cache=view, write_at=0,
                  logits_at=None)
            cache.keys[:, row], cache.values[:, row] = view.keys[:, 0], view.values[:, 0]
            tree = (DraftTree.chain(torch.randint(0, vocab, (draft_tokens,), generator=generator).tolist())
                    if row in drafted else DraftTree.empty())
            inputs.append(RowInput(row, length, int(torch.randint(0, vocab, (1,), generator=generator)), tree))
    runs: list[list[RowInput]] = []  # neighbouring rows of one length
    for item in inputs:
        if runs and runs[-1][-1].size == item.size:
            runs[-1].append(item)
        else:
            runs.append([item])
    split = [(run[0].row, build_decode_batch([replace(i, row=i.row - run[0].row) for i in run])) for run in runs]
    shapes = {
        "plain": [(0, build_decode_batch([RowInput(i.row, i.context_length, i.root) for i in inputs]))],
        "padded": [(0, build_decode_batch(inputs))],
        "split": split,
        "ragged": [(0, build_ragged_batch(inputs))],
    }
    rows = {name: sum(batch.input_ids.numel() for _, batch in passes) for name, passes in shapes.items()}
    cpu: dict[str, list[float]] = {name: [] for name in shapes}
    wall: dict[str, list[float]] = {name: [] for name in shapes}
    with torch.inference_mode():
        for round_index in range(repeats + 1):  # round 0 warms up
            for name, passes in shapes.items():
                cpu_started, wall_started = time.process_time(), time.perf_counter()
                for first, batch in passes:
                    view = copy.copy(cache)  # rows first.. (a pool's view)
                    view.keys, view.values = cache.keys[:, first:], cache.values[:, first:]
                    out = model(batch.input_ids, batch.positions, cache=view, kv_len=batch.kv_len,
                                **batch.pass_arguments(), logits_at=None)
                    model.output_logits(out.hidden.reshape(-1, out.hidden.shape[-1]), greedy=True)
                if round_index:
                    cpu[name].append(time.process_time() - cpu_started)
                    wall[name].append(time.perf_counter() - wall_started)
    print(f"{sequences} sequences, {drafting} drafting {draft_tokens} tokens, contexts {min(contexts)}-{max(contexts)},"
          f" {torch.get_num_threads()} threads, {repeats} rounds alternating")
    for name in shapes:
        print(f"{name:7s} {len(shapes[name]):2d} passes {rows[name]:4d} rows  CPU {1000 * statistics.median(cpu[name]):7.2f} ms"
              f"  wall {1000 * statistics.median(wall[name]):7.2f} ms")
    print(f"split / ragged: CPU {statistics.median(cpu['split']) / statistics.median(cpu['ragged']):.2f}x,"
          f" wall {statistics.median(wall['split']) / statistics.median(wall['ragged']):.2f}x")
    print(f"padded / ragged: CPU {statistics.median(cpu['padded']) / statistics.median(cpu['ragged']):.2f}x,"
          f" wall {statistics.median(wall['padded']) / statistics.median(wall['ragged']):.2f}x")


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
