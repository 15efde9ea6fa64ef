"""`--draft suffix` on the real model (SmolLM2 in int4): greedy output token-identical to plain
decoding (alone and grafted onto the shipped EAGLE-3 head, MT-Bench and code prompts, each asked
twice so that the global store drafts too), and sampling at temperature 1 follows the target
exactly with suffix trees verified at every step."""

from __future__ import annotations

import pytest

from eyas.bench.prompts import CODE_PROMPTS
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.methods import build_proposer
from eyas.engine.speculative.policy import PolicyConfig
from eyas.engine.speculative.proposers.suffix import SuffixConfig, SuffixProposer
from eyas.engine.speculative.sizing import CostModel
from eyas.models.tokenizer import chat_prompt_ids
from spec_checks import assert_greedy_equals_plain
from stat_checks import exact_joint, goodness_of_fit

NEW_TOKENS = 32
# a fixed cost curve (SmolLM2 int4 on 2 cores: a one-token pass, then ~1.8 ms per extra row), so
# that where the trees are cut, and so the step counts asserted below, do not follow whatever
# curve a benchmark last cached on this machine
FIXED_COSTS = CostModel({1: 5.0e-3, 16: 5.0e-3 + 15 * 1.8e-3, 64: 5.0e-3 + 63 * 1.8e-3})


@pytest.fixture(scope="module")
def target(smollm_int4_target):
    """SmolLM2 in int4, as served by default (the fused C++ layers verify the trees)."""
    return smollm_int4_target


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer, mtbench_prompt_ids) -> list[list[int]]:
    code = [chat_prompt_ids(smollm_tokenizer, [{"role": "user", "content": q}]) for q in CODE_PROMPTS[:2]]
    return mtbench_prompt_ids[:2] + code


@pytest.fixture(scope="module")
def plain_outputs(target, prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS)
    return [generate(target, p, params).token_ids for p in prompts]


def test_suffix_greedy_equals_plain_and_the_store_drafts_the_second_ask(target, prompts,
                                                                       plain_outputs):
    proposer = build_proposer("suffix:4", target)
    proposer.use_costs(FIXED_COSTS)
    counters = ("draft_tokens", "accepted_tokens", "verification_steps", "plain_steps")
    first = assert_greedy_equals_plain(target, prompts, proposer, 16, NEW_TOKENS, plain_outputs,
                                       counters=counters)
    assert proposer.store.stats()["documents"] == len(prompts)  # every output was stored
    second = assert_greedy_equals_plain(target, prompts, proposer, 16, NEW_TOKENS, plain_outputs,
                                        counters=counters)
    assert first["draft_tokens"] > 0
    # the same prompts again: the answers are in the store, most of them are drafted
    assert second["accepted_tokens"] > 0.6 * len(prompts) * NEW_TOKENS
    # fewer target passes: steps that verified a tree plus steps with nothing to draft (the
    # first ask has many of those: its store is empty, only the request's own text matches)
    passes = [run["verification_steps"] + run["plain_steps"] for run in (first, second)]
    assert passes[1] < passes[0]
    assert passes[1] <= len(prompts) * NEW_TOKENS // 4  # 13 of 128 tokens' passes seen (97 first)


def test_suffix_on_the_tiny_model_equals_plain_and_the_store_helps_the_second_ask(tiny_target):
    prompts = [[5, 6, 7, 8, 9] * 6, list(range(300, 330)), [40, 41, 42] * 8]
    proposer = SuffixProposer(SuffixConfig(cache_mb=1, priced=False))
    first = assert_greedy_equals_plain(tiny_target, prompts, proposer, 8, 24)
    second = assert_greedy_equals_plain(tiny_target, prompts, proposer, 8, 24)
    assert second["accepted_tokens"] > first["accepted_tokens"]
    assert proposer.store.stats()["hits"] > 0


def test_eagle3_with_suffix_graft_greedy_equals_plain(target, prompts, plain_outputs):
    proposer = build_proposer("eagle3:smollm2-135m+suffix:4", target, tree="auto")
    first = assert_greedy_equals_plain(target, prompts, proposer, 16, NEW_TOKENS, plain_outputs)
    second = assert_greedy_equals_plain(target, prompts, proposer, 16, NEW_TOKENS, plain_outputs)
    assert first["accepted_tokens"] > 0
    assert second["accepted_tokens"] > first["accepted_tokens"]  # the store's branches help
    assert proposer.grafted > 0


def test_sampled_tokens_with_suffix_trees_follow_the_target(tiny_target):
    """temperature 1, top-k 3: the joint distribution of the first three tokens, with a suffix
    tree drafted at every step (the store holds every three-token answer the sampler can give,
    with unequal counts, so that the trees branch; each output then joins it), equals the target's own, computed exactly."""
    prompt = list(range(200, 212))
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=seed, ignore_eos=True)
              for seed in range(600)]
    probs = exact_joint(tiny_target, prompt, params[0], 3)
    assert len(probs) == 27
    proposer = SuffixProposer(SuffixConfig(cache_mb=4, max_depth=8, max_match=4, priced=False))
    for rank, seq in enumerate(sorted(probs)):
        for _ in range(1 + rank % 3):
            proposer.store.add(prompt[-4:] + list(seq))
    counts: dict[tuple, int] = {}
    drafted = 0
    for sampling in params:
        result = speculative_generate(tiny_target, prompt, sampling, proposer, 3,
                                      policy=PolicyConfig(enabled=False))
        seq = tuple(result.token_ids[:3])
        counts[seq] = counts.get(seq, 0) + 1
        drafted += result.stats["speculative"]["draft_tokens"]
    assert drafted >= len(params)  # trees under the first token, every time
    p_value, dof = goodness_of_fit(counts, probs)
    assert dof >= 8 and p_value > 1e-3, (p_value, dof, counts)
