"""Speculative decoding of one request: propose -> verify -> accept -> emit.

Usage:
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.proposers.ngram import NgramProposer
    result = speculative_generate(target, prompt_ids, SamplingParams(max_tokens=128),
                                  NgramProposer(), num_draft_tokens=4)
    result.stats["speculative"]["acceptance_length"]

The steps run in the serving engine with one row (eyas.scheduler.single.generate_one:
executor.py drafts, verifies in one pass and accepts), so that a feature (logprobs, logits
processors, grammar pruning) lives in one code path. Greedy output equals plain greedy
decoding (up to floating-point near-ties, see the tests); sampled output follows the target's
distribution exactly (acceptance.py).
"""

from __future__ import annotations

from typing import Callable, Sequence as Seq

from eyas.engine.logits_process import LogitsProcessor
from eyas.engine.sampling import SamplingParams
from eyas.engine.sequence import GenerationResult
from eyas.engine.speculative.policy import PolicyConfig
from eyas.engine.speculative.proposers.base import Proposer
from eyas.engine.target import Target


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
    ask for (logit_bias and penalties, engine/penalties.py). `policy` is the fallback rule
    (engine/speculative/policy.py; PolicyConfig(enabled=False): every step drafts)."""
    from eyas.scheduler.single import generate_one

    return generate_one(target, prompt_ids, params, proposer, num_draft_tokens, on_text, policy,
                        logits_processors)
