"""Verification: one target pass over [root + draft nodes], acceptance, KV compaction."""

from __future__ import annotations

from typing import Sequence as Seq

import torch

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
) -> tuple[VerifyResult, ForwardOutput]:
    """Run the target over root + drafts at slots context_length.., accept, compact the cache.

    Afterwards slots [0, context_length + 1 + accepted) hold the context, the root and the
    accepted path, contiguous; the emitted tokens' last one (recovered/bonus) is the next root.
    """
    # 1. One pass: each node sees the context, its ancestors and itself.
    device = target.device
    if not tree.size:  # a plain step: the root alone, as plain decoding runs it
        output = target.model(torch.tensor([[root_token]], device=device), cache=cache,
                              write_at=context_length, tap_layers=tap_layers, greedy=params.greedy)
    else:
        ids, positions, mask = verification_inputs(tree, root_token, context_length)
        output = target.model(
            ids.to(device), positions.to(device), cache=cache, write_at=context_length,
            attn_mask=mask.to(device), kv_len=context_length + tree.size + 1,
            tap_layers=tap_layers, greedy=params.greedy,
        )
    logits = output.logits[0]  # [N+1, V]
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
