"""Verification: one target pass over [root + draft nodes], acceptance, KV compaction."""

from __future__ import annotations

from typing import Sequence as Seq

import torch

from eyas.engine.logits_process import LogitsProcessor, process_tree_rows
from eyas.engine.sampling import SamplingParams, target_probs
from eyas.engine.speculative.acceptance import accept_greedy, accept_sampling
from eyas.engine.speculative.draft import DraftTree, VerifyResult
from eyas.engine.speculative.tree import verification_inputs
from eyas.engine.target import Target
from eyas.models.kv_cache import KVCache
from eyas.models.llama import ForwardOutput


@torch.inference_mode()
def verify(
    target: Target,
    cache: KVCache,
    context_length: int,
    root_token: int,
    tree: DraftTree,
    params: SamplingParams,
    generator: torch.Generator | None,
    tap_layers: Seq[int] = (),
    logits_processors: Seq[LogitsProcessor] = (),
    output_ids: Seq[int] = (),
) -> tuple[VerifyResult, ForwardOutput]:
    """Run the target over root + drafts at slots context_length.., accept, compact the cache.

    Afterwards slots [0, context_length + 1 + accepted) hold the context, the root and the
    accepted path, contiguous; the emitted tokens' last one (recovered/bonus) is the next root.
    logits_processors change every row before acceptance, row i with `output_ids` (the
    completion so far, root included) plus the path to node i (engine/logits_process.py).
    The returned output keeps the raw logits.
    """
    # 1. One pass: each node sees the context, its ancestors and itself. Only a greedy step
    # without processors may screen the output layer (every logit is read otherwise).
    device = target.device
    screen = params.greedy and not logits_processors
    if not tree.size:  # a plain step: the root alone, as plain decoding runs it
        output = target.model(torch.tensor([[root_token]], device=device), cache=cache,
                              write_at=context_length, tap_layers=tap_layers, greedy=screen)
    else:
        ids, positions, mask = verification_inputs(tree, root_token, context_length)
        output = target.model(
            ids.to(device), positions.to(device), cache=cache, write_at=context_length,
            attn_mask=mask.to(device), kv_len=context_length + tree.size + 1,
            tap_layers=tap_layers, greedy=screen,
        )
    logits = output.logits[0]  # [N+1, V]
    if logits_processors:
        hidden = output.hidden[0]  # [N+1, H]
        recompute = ((lambda row: target.model.output_logits(hidden[row][None, None])[0, 0])
                     if params.greedy else None)
        logits = process_tree_rows(logits, logits_processors, output_ids, tree, recompute)
    # 2. Acceptance.
    if params.greedy:
        result = accept_greedy(tree, logits)
    else:
        result = accept_sampling(tree, target_probs(logits, params), generator)
    # 3. The accepted path's entries become contiguous after the root; the rest is scratch.
    if result.accepted_nodes:
        keep = [context_length + node for node in result.accepted_nodes]
        cache.compact(0, keep, start=context_length + 1)
    return result, output
