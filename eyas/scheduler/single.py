"""One request decoded on the caller's thread by a one-row engine: what `eyas generate`,
`eyas eval` and `eyas bench offline` run, plain or speculative.

Usage:
    from eyas.scheduler.single import generate_one
    result = generate_one(target, prompt_ids, SamplingParams(max_tokens=128), on_text=print)
    result = generate_one(target, prompt_ids, params, proposer=NgramProposer(), num_draft_tokens=4)
    result.stats["speculative"]["acceptance_length"]

There is one decoding path: the serving engine's (engine.py, executor.py), here with one KV
row, the prompt prefilled in one chunk, no prefix cache (each call is measured on its own),
and speculation "timed" (config.py): the proposer sizes its own drafts (`single_stream`) and
hears each step's wall time, and the policy (engine/speculative/policy.py) falls back to plain
steps while timed speculative steps are slower per token. Logits processors, logprobs, grammar
pruning and the proposer's `finish` (suffix decoding's store) are the engine's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence as Seq

from eyas.engine.logits_process import LogitsProcessor
from eyas.engine.sampling import SamplingParams
from eyas.engine.sequence import GenerationResult
from eyas.engine.speculative.policy import PolicyConfig
from eyas.engine.speculative.proposers.base import Proposer
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.engine import Engine
from eyas.scheduler.output import generation_result
from eyas.scheduler.request import RequestOutput


def generate_one(
    target: Target,
    prompt_ids: list[int],
    params: SamplingParams,
    proposer: Proposer | None = None,
    num_draft_tokens: int = 4,
    on_text: Callable[[str], None] | None = None,
    policy: PolicyConfig | None = None,
    logits_processors: Seq[LogitsProcessor] = (),
) -> GenerationResult:
    """Decode one prompt; `on_text` receives text deltas as they become final. With a
    `proposer`, each step drafts at most `num_draft_tokens` under the root and verifies them in
    one pass (greedy output equals plain greedy output; sampled output follows the target's
    distribution). `logits_processors` change every position's logits (the prompt's last, each
    draft node with the path to it) after those `params` ask for (logit_bias, penalties).
    max_tokens is cut to what fits in the model's context; a prompt that does not fit raises."""
    from eyas.engine.generate import check_lengths

    new_tokens = check_lengths(target, len(prompt_ids), params)
    if new_tokens != params.max_tokens:
        params = replace(params, max_tokens=new_tokens)
    length = len(prompt_ids) + new_tokens
    config = EngineConfig(
        max_running=1, max_waiting=1, max_model_len=length,
        max_step_tokens=max(len(prompt_ids), num_draft_tokens + 1), prefill_chunk=len(prompt_ids),
        num_draft_tokens=num_draft_tokens, speculation="timed" if proposer is not None else "never",
        policy=policy, prefix_caching=False, initial_kv_slots=length + num_draft_tokens + 1)
    engine = Engine(target, config, draft=proposer if proposer is not None else "none")
    return run_here(engine, [prompt_ids], [params], [logits_processors], on_text)[0]


def generate_together(target: Target, prompts: list[list[int]], params: SamplingParams
                      ) -> list[GenerationResult]:
    """Plain decoding of several prompts at once (continuous batching, on this thread); each
    result equals decoding its prompt alone. Seeded sampling gives prompt i the seed
    `seed + i`. max_tokens is cut per prompt to what fits in the context."""
    from eyas.engine.generate import check_lengths

    if not prompts:
        return []
    each = [replace(params, max_tokens=check_lengths(target, len(prompt), params)).for_sample(index)
            for index, prompt in enumerate(prompts)]
    longest = max(len(prompt) + p.max_tokens for prompt, p in zip(prompts, each))
    config = EngineConfig(
        max_running=len(prompts), max_waiting=len(prompts), max_model_len=longest,
        max_step_tokens=max(sum(len(prompt) for prompt in prompts), len(prompts)),
        prefill_chunk=max(len(prompt) for prompt in prompts), speculation="never",
        prefill_stretch=None, prefix_caching=False, initial_kv_slots=longest + 1)
    return run_here(Engine(target, config), prompts, each, [()] * len(prompts))


def run_here(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
             processors: list[Seq[LogitsProcessor]], on_text: Callable[[str], None] | None = None
             ) -> list[GenerationResult]:
    """Submit the prompts and run the engine's loop on this thread until all are done; a
    request whose decoding raised re-raises its error here."""
    outputs: list[list[RequestOutput]] = [[] for _ in prompts]

    def collector(index: int) -> Callable[[RequestOutput], None]:
        def on_output(output: RequestOutput) -> None:
            outputs[index].append(output)
            if on_text is not None and output.text:
                on_text(output.text)
        return on_output

    requests = [engine.submit(prompt, request_params, collector(index), logits_processors=request_processors)
                for index, (prompt, request_params, request_processors)
                in enumerate(zip(prompts, params, processors))]
    engine.run(stop_when=lambda: True)  # until every request is done
    results = []
    for request, collected in zip(requests, outputs):
        final = collected[-1] if collected else None
        if final is None or not final.finished:
            raise EyasError(f"the engine stopped before {request.request_id} finished")
        if final.finish_reason == "error":
            failure = request.failure
            if failure is not None and failure.error is not None:
                raise failure.error
            raise EyasError(f"decoding failed: {final.error}")
        results.append(generation_result(request, collected))
    return results
