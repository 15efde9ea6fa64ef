"""What one decode pass of B requests with T queries each costs, timed the way the executor runs
it: the numbers behind `StepCostModel` (speculation.py), which prices every draft the serving
engine considers.

Each shape is timed as a greedy step of the executor (executor.py) computes it:

- B = 1: the lone request's step, `decode_one` / `decode_rows` over its root and a chain of
  T - 1 drafts, then `greedy_tokens` (its argmax from the output screen, no logits made); a
  model whose fused stack does not run (float32) takes the dense pass of one row;
- B > 1: one ragged pass (batch.py's `build_ragged_batch`: every request's root and chain, no
  padding), then `greedy_tokens` over all its queries (the screen's argmax, or
  `output_logits(..., greedy=True)`'s for a layer that does not screen).

What the passes read matters as much as how they run. Every row's context and queries are text
(sizing.SAMPLE_TEXT), not random ids: over random ids the model is unsure of everything, the
output screen re-checks many candidates exactly, and on SmolLM2 (Zen 4) the output layer then
took 2-8 ms a pass instead of ~1, which priced a two-token pass at 5.4-6.3 ms against the
executor's 4.3 and switched drafting off at one request. Within a round the shapes run from
the widest down (a narrow pass right after a wide one runs slower for a few passes:
sizing._interleaved_medians), a cheap shape several times back to back, and each shape's
median sample is kept: with one sample a round, the two-query pass of one request came out 0.0
to 0.7 ms above the one-query pass in start-ups of the same minute (Zen 4), and the serving rule
follows that difference for the server's life (the measured steps scale every T of a B alike).

Usage:
    table = measure_pass_costs(target, batch_sizes=[1, 2, 4], max_tokens_per_row=5)
    table[(4, 2)]   # seconds of a pass over 4 requests, each its root and one draft
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.sizing import sample_tokens
from eyas.scheduler.batch import RowInput, build_decode_batch, build_ragged_batch, tree_row

# Each round times a shape back to back until ~SECONDS_PER_SHAPE have passed (at most
# MAX_REPEATS times): the cheap shapes of one request, whose differences decide whether a lone
# request drafts (0.2-0.5 ms between one and two queries), get the most samples.
SECONDS_PER_SHAPE = 0.02
MAX_REPEATS = 8

if TYPE_CHECKING:
    from eyas.engine.target import Target
    from eyas.models.kv_cache import KVCache


@torch.inference_mode()
def measure_pass_costs(target: Target, batch_sizes: Sequence[int], max_tokens_per_row: int,
                       context: int = 64, rounds: int = 3) -> dict[tuple[int, int], float]:
    """Median seconds of the executor's greedy pass for every B in `batch_sizes` and T in
    1..max_tokens_per_row, over a `context`-token cache of text in every row. One warm-up
    round, then `rounds` timed ones; each round visits every shape, widest first, each shape
    for ~SECONDS_PER_SHAPE."""
    from eyas.engine.generate import new_cache

    text = sample_tokens(target, context + max_tokens_per_row)  # [1, context + T]
    steps: dict[tuple[int, int], Callable[[], None]] = {}
    for batch in batch_sizes:
        cache = new_cache(target, batch, context + max_tokens_per_row)
        ids = text[:, :context].expand(batch, context).contiguous()  # [B, context]
        target.model(ids, cache=cache, write_at=0, logits_at=None)
        for tokens in range(1, max_tokens_per_row + 1):
            steps[(batch, tokens)] = greedy_pass(target, cache, batch, tokens, context,
                                                 text[0, context:].tolist())
    order = sorted(steps, key=lambda shape: shape[0] * shape[1], reverse=True)
    times: dict[tuple[int, int], list[float]] = {shape: [] for shape in steps}
    repeats = dict.fromkeys(steps, 1)
    for round_index in range(rounds + 1):  # round 0 warms every shape up and sizes the repeats
        for shape in order:
            for _ in range(repeats[shape]):
                started = time.perf_counter()
                steps[shape]()
                seconds = time.perf_counter() - started
                if round_index > 0:
                    times[shape].append(seconds)
                else:
                    repeats[shape] = max(1, min(MAX_REPEATS, round(SECONDS_PER_SHAPE / max(seconds, 1e-6))))
    return {shape: float(np.median(values)) for shape, values in times.items()}


def greedy_pass(target: Target, cache: KVCache, batch: int, tokens: int, context: int,
                queries: list[int]) -> Callable[[], None]:
    """One greedy decode step of `batch` requests, each its root and a chain of tokens - 1
    drafts (`queries`' first tokens) after `context` committed slots of its own cache row:
    the call the executor makes for that shape (see the module docstring)."""
    model = target.model
    chain = DraftTree.chain(queries[1:tokens]) if tokens > 1 else None
    if batch == 1:
        ids, positions, mask = tree_row(queries[0], chain or DraftTree.empty(), context)

        def one_row():  # ForwardOutput, or None where the fused stack does not run
            if chain is None:
                return model.decode_one(queries[0], context, cache)
            return model.decode_rows(ids, positions, context, mask, cache)

        if one_row() is not None:
            return lambda: model.greedy_tokens(one_row().hidden)
    inputs = [RowInput(row, context, queries[0], chain) for row in range(batch)]
    build = build_decode_batch if batch == 1 else build_ragged_batch  # as the executor's
    pass_input = build(inputs, target.device)

    def step() -> None:
        output = model(pass_input.input_ids, pass_input.positions, cache=cache,
                       kv_len=pass_input.kv_len, **pass_input.pass_arguments(), logits_at=None)
        model.greedy_tokens(output.hidden[0])  # [N, H]
    return step
