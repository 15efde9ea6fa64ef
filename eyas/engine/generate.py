"""Plain decoding: one prompt (streamed) or a batch of prompts of different lengths; the
length rule and the KV cache of one pass.

Usage:
    from eyas.engine.target import load_target
    from eyas.engine.generate import generate, generate_batch, SamplingParams
    target = load_target("smollm2-135m")
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    result = generate(target, ids, SamplingParams(max_tokens=128), on_text=print)
    results = generate_batch(target, [ids_a, ids_b], SamplingParams(max_tokens=64))

Both run in the serving engine on the calling thread (eyas.scheduler.single): the one decoding
path that plain, speculative and served requests share.
"""

from __future__ import annotations

from typing import Callable, Sequence as Seq

from eyas.engine.logits_process import LogitsProcessor
from eyas.engine.sampling import SamplingParams
from eyas.engine.sequence import GenerationResult
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
    and penalties, engine/penalties.py). The serving engine with one row decodes it
    (eyas.scheduler.single.generate_one)."""
    from eyas.scheduler.single import generate_one

    return generate_one(target, prompt_ids, params, on_text=on_text, logits_processors=logits_processors)


def generate_batch(target: Target, prompts: list[list[int]], params: SamplingParams
                   ) -> list[GenerationResult]:
    """Decode prompts of different lengths together; each result equals decoding it alone.
    Seeded sampling gives row i the seed `seed + i`. The serving engine batches them
    (eyas.scheduler.single.generate_together)."""
    from eyas.scheduler.single import generate_together

    return generate_together(target, prompts, params)
