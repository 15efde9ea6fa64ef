"""Sampling at temperature 1 stays lossless on the real model with the shipped EAGLE-3 head.

SmolLM2-135M in int4 (its fused layers) and the shipped head (fused beside it), served by the
engine with a seed per request, drafting a tree at every step: the joint distribution of the
first three answer tokens equals the target's own, computed exactly by enumerating the
top-k prefixes (chi-square goodness of fit). The first token comes from the prefill; the
second and third are decided by accepting or rejecting the head's drafts at depths 1 and 2.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from eyas.engine.sampling import SamplingParams
from eyas.models.tokenizer import chat_prompt_ids
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.engine import Engine
from stat_checks import exact_joint, goodness_of_fit

TOP_K = 3  # 27 sequences of three tokens, each likely enough to be counted
SAMPLES = 900
P_VALUE = 1e-3


@pytest.mark.slow  # 900 requests through the engine on the real model: about a minute on 2 cores
def test_sampled_answers_with_the_shipped_head_follow_the_target(smollm_int4_target, smollm_tokenizer):
    target = smollm_int4_target
    prompt = chat_prompt_ids(smollm_tokenizer, [{"role": "user", "content": "List three colors."}])
    # a fourth token leaves room for two drafts after the first token (a step emits at most
    # drafts + 1 of the tokens still wanted); only the first three are counted
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=TOP_K, seed=seed, ignore_eos=True)
              for seed in range(SAMPLES)]
    config = EngineConfig(max_running=32, max_waiting=SAMPLES, speculation="always", tree="2,2,4")
    served = Engine(target, config, draft="eagle3:smollm2-135m").start()
    try:
        results = served.generate_many([prompt] * SAMPLES, params, 600)
    finally:
        served.shutdown()
    counts: dict[tuple, int] = {}
    for result in results:
        seq = tuple(result.token_ids[:3])
        counts[seq] = counts.get(seq, 0) + 1
    spec = [r.stats["speculative"] for r in results]
    drafted = sum(s["draft_tokens"] for s in spec)
    accepted = sum(s["accepted_tokens"] for s in spec)
    assert drafted > 1.5 * SAMPLES and 0 < accepted < drafted  # the head drafted, some drafts were kept

    probs = exact_joint(target, prompt, params[0], 3)
    assert abs(sum(probs.values()) - 1) < 1e-6 and len(probs) == TOP_K ** 3
    p_value, dof = goodness_of_fit(counts, probs)
    assert dof >= 10 and p_value > P_VALUE, (p_value, dof, counts)


def test_the_goodness_of_fit_check_rejects_a_wrong_distribution():
    """The check above can fail: counts drawn from a distribution that moves about a tenth of the
    mass between sequences are rejected."""
    generator = torch.Generator().manual_seed(0)
    seqs = list(itertools.product(range(3), repeat=3))
    true = torch.rand(len(seqs), generator=generator, dtype=torch.float64) + 0.5
    true /= true.sum()
    wrong = true.clone()
    wrong[:9] *= 1.5
    wrong /= wrong.sum()
    draws = torch.multinomial(wrong, SAMPLES, replacement=True, generator=generator)
    counts: dict[tuple, int] = {}
    for index in draws.tolist():
        counts[seqs[index]] = counts.get(seqs[index], 0) + 1
    p_value, _ = goodness_of_fit(counts, dict(zip(seqs, true.tolist())))
    assert p_value < P_VALUE
    right = torch.multinomial(true, SAMPLES, replacement=True, generator=generator)
    counts = {}
    for index in right.tolist():
        counts[seqs[index]] = counts.get(seqs[index], 0) + 1
    assert goodness_of_fit(counts, dict(zip(seqs, true.tolist())))[0] > P_VALUE


@pytest.mark.slow  # 8 sampled answers plain and speculative on the real model: ~1 minute on 2 cores
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_seeded_plain_temperature_answers_are_the_same_with_the_shipped_head(smollm_int4_target,
                                                                             mtbench_prompt_ids, temperature):
    """Plain-temperature rows draw each position's token through the screen with that position's
    noise (engine/gumbel.py), in plain steps and at tree nodes alike; the int4 target's fused
    layers give every position the same logits in any pass, so a seeded answer is the same
    token for token with the EAGLE-3 head (+ the n-gram graft) drafting."""
    from eyas.engine import gumbel
    from eyas.engine.generate import generate
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.methods import build_proposer
    from eyas.engine.speculative.policy import PolicyConfig

    target = smollm_int4_target
    assert gumbel.available() and hasattr(target.model.lm_head, "sample_tokens")
    accepted = 0
    for seed, prompt in enumerate(mtbench_prompt_ids[:4]):
        params = SamplingParams(max_tokens=32, temperature=temperature, seed=seed, ignore_eos=True)
        plain = generate(target, prompt, params).token_ids
        proposer = build_proposer("eagle3:smollm2-135m+ngram", target, tree="3,2,4")
        spec = speculative_generate(target, prompt, params, proposer, 8, policy=PolicyConfig(enabled=False))
        assert spec.token_ids == plain
        accepted += spec.stats["speculative"]["accepted_tokens"]
    assert accepted > 4 * 32 // 4  # a trained head's drafts are accepted at these temperatures
