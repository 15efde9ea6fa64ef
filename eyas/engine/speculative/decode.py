"""The speculative decode loop: propose -> verify -> accept -> emit, one request.

Usage:
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.proposers.ngram import NgramProposer
    result = speculative_generate(target, prompt_ids, SamplingParams(max_tokens=128),
                                  NgramProposer(), num_draft_tokens=4)
    result.stats["speculative"]["acceptance_length"]

Greedy output equals plain greedy decoding (up to floating-point near-ties, see the tests);
sampled output follows the target's distribution exactly (acceptance.py).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence as Seq

import torch

from eyas.engine.generate import check_lengths, new_cache
from eyas.engine.logits_process import LogitsProcessor, process_tree_rows
from eyas.engine.penalties import sampling_processors
from eyas.engine.sampling import SamplingParams, next_tokens
from eyas.engine.sequence import GenerationResult, Sequence
from eyas.engine.speculative.draft import DraftTree, SpecMetrics
from eyas.engine.speculative.policy import PolicyConfig, SpeculationPolicy
from eyas.engine.speculative.proposers.base import Proposer
from eyas.engine.speculative.prune import prune_draft
from eyas.engine.speculative.tree import node_depths
from eyas.engine.speculative.verifier import verify
from eyas.engine.target import Target


@torch.inference_mode()
def speculative_generate(
    target: Target,
    prompt_ids: list[int],
    params: SamplingParams,
    proposer: Proposer,
    num_draft_tokens: int = 4,
    on_text: Callable[[str], None] | None = None,
    policy: PolicyConfig | None = None,
    logits_processors: Seq[LogitsProcessor] = (),
) -> GenerationResult:
    """Decode one prompt speculatively; `logits_processors` change the target's logits at
    every position (the prompt's last and every node of every draft tree) before a token is
    chosen, as plain `generate` applies them (engine/logits_process.py), after those `params`
    ask for (logit_bias and penalties, engine/penalties.py)."""
    new_tokens = check_lengths(target, len(prompt_ids), params)
    sequence = Sequence(prompt_ids, params, target.tokenizer, target.eos_token_ids, new_tokens)
    generator = params.generator(target.device)
    cache = new_cache(target, 1, len(prompt_ids) + new_tokens + num_draft_tokens + 2)
    logits_processors = sampling_processors(params, prompt_ids) + list(logits_processors)
    metrics = SpecMetrics()
    switch = SpeculationPolicy(policy)
    proposer.begin(target, prompt_ids, params)
    if hasattr(proposer, "single_stream"):  # priced n-grams, EAGLE-3 probes (proposers/)
        proposer.single_stream(target)
    step_clock = getattr(proposer, "step_seconds", None)  # EAGLE-3 sizing on measured steps
    # 1. Prefill, then the first token comes from the prompt's last logits.
    started = time.perf_counter()
    ids = torch.tensor([prompt_ids], device=target.device)
    output = target.model(ids, cache=cache, write_at=0, logits_at="last",
                          tap_layers=proposer.tap_layers, greedy=params.greedy and not logits_processors)
    proposer.observe(DraftTree.empty(), None, output)
    last = process_tree_rows(output.logits[:, -1], logits_processors, [], DraftTree.empty())  # [1, V]
    root = int(next_tokens(last, params, generator)[0])
    sequence.append([root])
    first_token_at = time.perf_counter()
    emit(sequence, on_text)
    context_length = len(prompt_ids)
    # 2. Steps: draft under the root, verify in one pass, emit accepted + recovered/bonus.
    while not sequence.finished:
        step_started = time.perf_counter()
        remaining = sequence.max_new_tokens - len(sequence.output_ids)
        speculate = switch.speculate_now()
        tree = DraftTree.empty()
        if speculate:
            budget = min(num_draft_tokens, remaining - 1)
            tree = proposer.propose(sequence.all_ids, budget)
            # drafts a grammar forbids are dropped before verification (prune.py)
            tree = prune_draft(proposer, tree, logits_processors, sequence.output_ids, budget)
        drafted_at = time.perf_counter()
        result, output = verify(target, cache, context_length, root, tree, params, generator,
                                proposer.tap_layers, logits_processors, sequence.output_ids)
        proposer.observe(tree, result, output)
        sequence.append(result.emitted)
        context_length += 1 + len(result.accepted_nodes)
        root = result.next_token
        finished_at = time.perf_counter()
        if step_clock is not None:
            step_clock(tree.size, finished_at - step_started)
        if tree.size:
            metrics.record(tree, node_depths(tree), result)
            metrics.draft_seconds += drafted_at - step_started
            metrics.verify_seconds += finished_at - drafted_at
            switch.record_speculative(finished_at - step_started, len(result.emitted))
        else:
            metrics.plain_steps += 1
            metrics.plain_seconds += finished_at - step_started
            switch.record_plain(finished_at - step_started)
        emit(sequence, on_text)
    done = time.perf_counter()
    if hasattr(proposer, "finish"):  # suffix decoding: the output joins the global store
        proposer.finish()
    metrics.fallbacks = switch.fallbacks
    decode_tokens = max(len(sequence.output_ids) - 1, 0)
    stats = {
        "ttft_s": first_token_at - started,
        "decode_s": done - first_token_at,
        "tokens_per_s": decode_tokens / max(done - first_token_at, 1e-9),
        "speculative": {"method": proposer.name, **metrics.as_dict(),
                        **(proposer.stats() if hasattr(proposer, "stats") else {})},
    }
    return sequence.result(stats)


def emit(sequence: Sequence, on_text: Callable[[str], None] | None) -> None:
    if on_text is not None:
        delta = sequence.take_new_text()
        if delta:
            on_text(delta)
