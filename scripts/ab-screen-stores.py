"""The int8 output screen writing its results around the caches (streaming stores, the default)
against through them, alternated in one process.

    python scripts/ab-screen-stores.py [ROUNDS] [SEQUENCES:CONTEXT ...]   # default 5 rounds, 1:256 4:256 16:200 64:300

For each SEQUENCES:CONTEXT, SEQUENCES cache rows hold CONTEXT cached tokens each and one ragged
decode pass (one new token per sequence, as a continuous-batching step) runs with the greedy
output layer and the argmax of each row, as the serving engine reads it. Each round times 10
passes (fewer for 64 sequences) with each setting, one after the other; prints the median and
range over rounds of each setting's median pass, in ms. Every pass's tokens are checked equal
under both settings. Set the threads with OMP_NUM_THREADS.
"""

from __future__ import annotations

import statistics
import sys
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.engine.generate import new_cache
from eyas.engine.sampling import argmax_rows
from eyas.engine.speculative.sizing import sample_tokens
from eyas.engine.target import load_target
from eyas.models import extension
from eyas.scheduler.batch import RowInput, build_ragged_batch


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    shapes = [tuple(int(v) for v in spec.split(":")) for spec in sys.argv[2:]] or [(1, 256), (4, 256), (16, 200), (64, 300)]
    torch.set_grad_enabled(False)
    target = load_target("smollm2-135m", dtype="int4")
    model, native = target.model, extension.module()
    print(f"threads {torch.get_num_threads()}, screen streaming by default: {native.screen_streams()}")
    for sequences, context in shapes:
        cache = new_cache(target, sequences, context + 8)
        ids = sample_tokens(target, context + 1)
        model(ids[:, :context].expand(sequences, context).contiguous(), cache=cache, write_at=0, logits_at=None)
        batch = build_ragged_batch([RowInput(s, context, int(ids[0, context]), None) for s in range(sequences)])

        def step() -> torch.Tensor:
            out = model(batch.input_ids, batch.positions, cache=cache, kv_len=batch.kv_len,
                        **batch.pass_arguments(), logits_at=None)
            return argmax_rows(model.output_logits(out.hidden[0], greedy=True))

        passes = 4 if sequences >= 64 else 10
        times: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, torch.Tensor] = {}
        for _ in range(rounds):
            for streaming in (True, False):
                native.set_screen_streaming(streaming)
                tokens[streaming] = step()
                spent = []
                for _ in range(passes):
                    started = time.perf_counter()
                    step()
                    spent.append(time.perf_counter() - started)
                times[streaming].append(1e3 * statistics.median(spent))
        native.set_screen_streaming(True)
        assert torch.equal(tokens[True], tokens[False]), "the two settings chose different tokens"
        summary = []
        for streaming, label in ((True, "streamed"), (False, "cached")):
            values = times[streaming]
            summary.append(f"{label} {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        ratio = statistics.median(times[False]) / statistics.median(times[True])
        print(f"{sequences} x {context}: {' | '.join(summary)} ms a pass; cached / streamed {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
