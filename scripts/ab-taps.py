"""EAGLE-3 taps from the fused stack: one C++ call that copies them out against the calls split
at the taps that the forward made before, and a call without taps, on int4 SmolLM2.

    OMP_NUM_THREADS=2 python scripts/ab-taps.py [ROWS ...] [--context 256] [--rounds 300]
    # default: passes of 1 and 2 rows (a plain step, a one-token draft's verification)

Each pass: ROWS new tokens of one sequence after CONTEXT cached ones through all 30 layers
(csrc/int4_stack.cpp Int4Stack, no embedding, norm or output layer), written at the
same slots every time. Three ways, alternated within each round in a rotating order:
- `none`: one call, no taps;
- `split`: one call per stretch of layers between the taps (2, 15, 27): four calls;
- `one call`: one call filling the taps [N, 3, H] on the way.
Prints the median wall time of each in milliseconds and the ratios, and checks that the split
and the one call give the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.engine.generate import new_cache
from eyas.engine.target import load_target

TAP_LAYERS = (2, 15, 27)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("rows", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    target = load_target("smollm2-135m", dtype="int4")
    model = target.model
    stack = model.fused_layers()
    assert stack is not None, "the fused stack did not build"
    layers = list(range(len(stack)))
    generator = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {args.context} cached tokens, {args.rounds} rounds alternating,"
          f" taps {TAP_LAYERS}, kv {target.kv_dtype}")
    for rows in args.rows:
        cache = new_cache(target, 1, args.context + rows)
        ids = torch.randint(0, target.config.vocab_size, (1, args.context + rows), generator=generator)
        with torch.inference_mode():
            model(ids[:, : args.context], cache=cache, write_at=0, logits_at=None)
            positions = torch.arange(args.context, args.context + rows)[None]  # [1, T]
            cos_table, sin_table = model.rope_tables(args.context + rows)
            cos, sin = cos_table[positions[0]], sin_table[positions[0]]  # [N, D]
            x = model.embed_tokens(ids[0, args.context :]).contiguous()  # [N, H]
            mask = torch.ones(rows, args.context + rows, dtype=torch.bool).tril(args.context)[None]
            common = (cos, sin, cache)
            tail = (positions, args.context + rows, mask)

            def none() -> tuple[torch.Tensor, torch.Tensor | None]:
                return stack.run(x, *common, layers, *tail), None

            def split() -> tuple[torch.Tensor, torch.Tensor]:
                hidden, taps, start = x, [], 0
                for stop in TAP_LAYERS:
                    hidden = stack.run(hidden, *common, layers[start:stop], *tail)
                    taps.append(hidden)
                    start = stop
                return stack.run(hidden, *common, layers[start:], *tail), torch.stack(taps, dim=1)

            def one_call() -> tuple[torch.Tensor, torch.Tensor]:
                taps = x.new_empty(rows, len(TAP_LAYERS), x.shape[1])  # [N, 3, H]
                return stack.run(x, *common, layers, *tail, None, list(TAP_LAYERS), taps), taps

            ways = {"none": none, "split": split, "one call": one_call}
            split_out, split_taps = split()
            one_out, one_taps = one_call()
            assert torch.equal(split_out, one_out) and torch.equal(split_taps, one_taps), "the bits differ"
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            names = list(ways)
            for round_index in range(args.rounds + 1):  # round 0 warms up
                shift = round_index % len(names)
                for name in names[shift:] + names[:shift]:
                    started = time.perf_counter()
                    ways[name]()
                    if round_index:
                        seconds[name].append(time.perf_counter() - started)
        medians = {name: 1000 * statistics.median(values) for name, values in seconds.items()}
        cells = "  ".join(f"{name} {ms:.3f} ms" for name, ms in medians.items())
        print(f"{rows} row(s): {cells}  split / one call {medians['split'] / medians['one call']:.3f}x,"
              f" one call / none {medians['one call'] / medians['none']:.3f}x")


if __name__ == "__main__":
    main()
