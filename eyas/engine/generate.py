"""Plain decoding: one prompt (streamed) or a batch of prompts of different lengths.

Usage:
    from eyas.engine.target import load_target
    from eyas.engine.generate import generate, generate_batch, SamplingParams
    target = load_target("smollm2-135m")
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    result = generate(target, ids, SamplingParams(max_tokens=128), on_text=print)
    results = generate_batch(target, [ids_a, ids_b], SamplingParams(max_tokens=64))

Speculative decoding (eyas.engine.speculative) reuses `Sequence`, `prefill` and the sampling
rules from here, so that both paths stop, sample and detokenize identically.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence as Seq

import torch
from torch import Tensor

from eyas.engine.logits_process import LogitsProcessor, process_tree_rows
from eyas.engine.penalties import sampling_processors
from eyas.engine.sampling import SamplingParams, next_tokens
from eyas.engine.sequence import GenerationResult, Sequence
from eyas.engine.speculative.draft import DraftTree
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.models.kv_cache import KVCache

__all__ = ["generate", "generate_batch", "SamplingParams", "GenerationResult", "new_cache"]


def check_lengths(target: Target, prompt_len: int, params: SamplingParams) -> int:
    """Return how many new tokens fit in the context; raise if the prompt alone does not."""
    context = target.config.context_length
    if prompt_len == 0:
        raise EyasError("the prompt is empty")
    if prompt_len >= context:
        raise EyasError(
            f"the prompt has {prompt_len} tokens; the model's context is {context} tokens "
            f"(prompt + output must fit)"
        )
    return min(params.max_tokens, context - prompt_len)


def new_cache(target: Target, batch_size: int, slots: int) -> KVCache:
    config = target.config
    return KVCache(config.num_hidden_layers, batch_size, config.num_key_value_heads, slots,
                   config.head_dim, dtype=target.kv_dtype, device=target.device)


@torch.inference_mode()
def generate(
    target: Target,
    prompt_ids: list[int],
    params: SamplingParams,
    on_text: Callable[[str], None] | None = None,
    logits_processors: Seq[LogitsProcessor] = (),
) -> GenerationResult:
    """Decode one prompt; `on_text` receives text deltas as they become final.
    `logits_processors` change each position's logits (with the completion so far) before
    the token is chosen (engine/logits_process.py), after those `params` ask for (logit_bias
    and penalties, engine/penalties.py)."""
    new_tokens = check_lengths(target, len(prompt_ids), params)
    sequence = Sequence(prompt_ids, params, target.tokenizer, target.eos_token_ids, new_tokens)
    generator = params.generator(target.device)
    cache = new_cache(target, 1, len(prompt_ids) + new_tokens)
    model = target.model
    logits_processors = sampling_processors(params, prompt_ids) + list(logits_processors)
    # 1. Prefill: the whole prompt in one pass, logits only for its last position.
    started = time.perf_counter()
    ids = torch.tensor([prompt_ids], device=target.device)  # [1, T]
    # Greedy without processors reads only argmaxes: the output layer may screen
    # (models/output_layer.py); processed logits need every logit of the row.
    greedy = params.greedy and not logits_processors
    logits = model(ids, cache=cache, write_at=0, logits_at="last", greedy=greedy).logits[:, -1]  # [1, V]
    first_token_at = None
    position = len(prompt_ids)
    # 2. Decode one token per step until EOS, a stop string or max_tokens.
    while True:
        logits = process_tree_rows(logits, logits_processors, sequence.output_ids, DraftTree.empty())
        token = next_tokens(logits, params, generator)  # [1]
        sequence.append([int(token)])
        if first_token_at is None:
            first_token_at = time.perf_counter()
        if on_text is not None:
            delta = sequence.take_new_text()
            if delta:
                on_text(delta)
        if sequence.finished:
            break
        logits = model(token[:, None], cache=cache, write_at=position, logits_at="last",
                       greedy=greedy).logits[:, -1]
        position += 1
    finished = time.perf_counter()
    decode_tokens = max(len(sequence.output_ids) - 1, 0)
    stats = {
        "ttft_s": first_token_at - started,
        "decode_s": finished - first_token_at,
        "tokens_per_s": decode_tokens / max(finished - first_token_at, 1e-9),
    }
    return sequence.result(stats)


def left_padded_batch(prompts: list[list[int]], pad_id: int, device: torch.device
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """Right-align prompts: ids [B, T], positions [B, T], valid [B, T] (False on padding)."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    positions = torch.zeros((len(prompts), longest), dtype=torch.long)
    valid = torch.zeros((len(prompts), longest), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        start = longest - len(prompt)
        ids[row, start:] = torch.tensor(prompt)
        positions[row, start:] = torch.arange(len(prompt))
        valid[row, start:] = True
    return ids.to(device), positions.to(device), valid.to(device)


@torch.inference_mode()
def generate_batch(target: Target, prompts: list[list[int]], params: SamplingParams
                   ) -> list[GenerationResult]:
    """Decode prompts of different lengths together; each result equals decoding it alone.

    Prompts are right-aligned in one cache (padding masked out, positions counted per row);
    every step writes all rows at the same slot; finished rows leave the batch.
    Seeded sampling gives each row its own generator seeded with `seed + row`.
    """
    if not prompts:
        return []
    new_tokens = [check_lengths(target, len(p), params) for p in prompts]
    sequences = [Sequence(p, params, target.tokenizer, target.eos_token_ids, n)
                 for p, n in zip(prompts, new_tokens)]
    generators = [
        SamplingParams(**{**params.__dict__, "seed": params.seed + row}).generator(target.device)
        if params.seed is not None else None
        for row in range(len(prompts))
    ]
    processors = [sampling_processors(params, prompt) for prompt in prompts]  # penalties, bias
    greedy = params.greedy and not processors[0]  # processed logits need every logit
    pad_id = target.tokenizer.pad_token_id or 0
    ids, positions, valid = left_padded_batch(prompts, pad_id, target.device)
    batch, longest = ids.shape
    cache = new_cache(target, batch, longest + max(new_tokens))
    # 1. Prefill: causal over real tokens; padding rows attend to themselves only (no NaN).
    causal = torch.ones(longest, longest, dtype=torch.bool, device=target.device).tril()
    eye = torch.eye(longest, dtype=torch.bool, device=target.device)
    mask = causal & (valid[:, None, :] | eye)  # [B, T, T]
    logits = target.model(ids, positions, cache=cache, write_at=0, attn_mask=mask,
                          logits_at="last", greedy=greedy).logits[:, -1]  # [B, V]
    active = list(range(batch))  # original row of each cache row
    next_position = positions[:, -1] + 1  # [B]
    slot = longest
    # 2. Decode: one token for every active row per step.
    while True:
        tokens = [int(next_tokens(process_tree_rows(logits[i : i + 1], processors[row],
                                                    sequences[row].output_ids, DraftTree.empty()),
                                  params, generators[row])[0])
                  for i, row in enumerate(active)]
        keep = []
        for i, row in enumerate(active):
            sequences[row].append([tokens[i]])
            if not sequences[row].finished:
                keep.append(i)
        if not keep:
            break
        if len(keep) < len(active):  # finished rows leave the batch
            index = torch.tensor(keep, device=target.device)
            cache.keys, cache.values = cache.keys[:, index], cache.values[:, index]
            valid, next_position = valid[index], next_position[index]
            active = [active[i] for i in keep]
            tokens = [tokens[i] for i in keep]
        step_ids = torch.tensor(tokens, device=target.device)[:, None]  # [B, 1]
        valid = torch.cat([valid, torch.ones(len(active), 1, dtype=torch.bool, device=target.device)], 1)
        step_mask = valid[:, None, :]  # [B, 1, S]
        logits = target.model(step_ids, next_position[:, None], cache=cache, write_at=slot,
                              attn_mask=step_mask, logits_at="last", greedy=greedy).logits[:, -1]
        next_position = next_position + 1
        slot += 1
    return [s.result() for s in sequences]
