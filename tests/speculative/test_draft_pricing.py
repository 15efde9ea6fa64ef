"""A draft model's chain priced from measured costs (proposers/chain_pricing.py): a pair that
cannot pay decodes plain, and greedy output stays equal to plain whatever the pricing chose."""

from __future__ import annotations

import pytest

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.proposers.chain_pricing import ChainPricing
from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
from eyas.engine.speculative.sizing import CostModel
from tiny_models import build_tiny_model

# A 1.5B int4 target on a CPU: each extra verified token ~0.19 of a one-token pass.
TARGET = CostModel({t: 1.0 + 0.19 * (t - 1) for t in range(1, 17)})
PROMPT = list(range(200, 230))

pytestmark = pytest.mark.usefixtures("one_thread")


def settled(rate: float, draft_pass: float, steps: int = 200) -> ChainPricing:
    """Pricing after `steps` chains of 4 whose drafts were each accepted with `rate`."""
    pricing = ChainPricing(TARGET, draft_pass, explore_steps=0)
    for step in range(steps):
        accepted = 0
        while accepted < 4 and (step * 7919 + accepted * 104729) % 1000 < rate * 1000:
            accepted += 1
        pricing.acceptance.record(4, accepted)
    return pricing


def test_a_draft_a_third_of_the_target_drafts_long_chains_when_accepted():
    assert settled(0.95, 0.2).length(4) == 4
    # (1 + .9 + .81 + .73 + .66) / (1.76 + 4 / 3) beats a plain step: the whole budget, though
    # 3 would be a little better, so that every position's rate keeps being observed
    assert settled(0.9, 1 / 3).length(4) == 4
    assert settled(0.6, 1 / 3).length(4) == 1  # 4 would lose to plain; 1 is the best that pays


def test_a_rarely_accepted_draft_gets_plain_steps():
    assert settled(0.3, 1 / 3).length(4) == 0
    assert settled(0.0, 0.05).length(4) == 0


def test_a_draft_as_dear_as_the_target_never_drafts_not_even_to_explore():
    pricing = ChainPricing(TARGET, draft_pass=1.0)
    assert not pricing.could_pay(4)
    assert [pricing.length(4) for _ in range(5)] == [0] * 5
    cheap = ChainPricing(TARGET, draft_pass=0.2, explore_steps=2)
    assert [cheap.length(4) for _ in range(2)] == [4, 4]  # the prior alone would not draft 4
    for _ in range(10):
        cheap.acceptance.record(4, 0)
    assert [cheap.length(4) for _ in range(17)] == [0] * 16 + [4]  # a probe after 16 plain steps
    assert cheap.new_request(4)  # a draft never measured is trusted: read the prompt, explore
    assert cheap.length(4) == 4  # a new request explores once


def test_a_priced_out_pair_skips_new_requests_and_its_probes_back_off():
    pricing = ChainPricing(TARGET, draft_pass=0.2, explore_steps=0)
    pricing.measured("draft", 0.2, 0.2)  # measured: the prices are trusted from now on
    for _ in range(10):
        pricing.acceptance.record(4, 0)
    assert not pricing.new_request(4)  # no exploring step, no prefill of the draft
    lengths = [pricing.length(4) for _ in range(16 + 1 + 32 + 1 + 64 + 1)]
    assert [i for i, n in enumerate(lengths) if n] == [16, 49, 114]  # 16, then 32, then 64 plain
    # still priced out: the next request keeps the wait (128) and the plain steps counted toward it
    pricing.length(4)
    assert not pricing.new_request(4) and pricing.probe_wait == 128 and pricing.plain_in_a_row == 1
    assert [i for i, n in enumerate(pricing.length(4) for _ in range(128)) if n] == [127]
    for _ in range(40):
        pricing.acceptance.record(4, 4)  # the text turned predictable: chains pay
    assert pricing.new_request(4) and pricing.length(4) == 4


def test_measured_ratios_move_the_prices_together():
    pricing = settled(0.8, 0.3)
    before = pricing.length(4)
    for _ in range(30):  # the machine got 3x slower for everything: the same choice
        pricing.measured("plain", 3.0, 1.0)
        pricing.measured("verify", 3.0 * TARGET.verify(5), TARGET.verify(5))
        pricing.measured("draft", 0.9, 0.3)
    assert pricing.length(4) == before > 0
    for _ in range(30):  # only the draft's passes got dearer (3x): the chain must shrink
        pricing.measured("draft", 2.7, 0.3)
    assert pricing.length(4) < before


class FrozenPricing(ChainPricing):
    def measured(self, kind: str, seconds: float, modelled: float) -> None:
        pass  # the prices stay as given


@pytest.fixture(scope="module")
def stranger_draft(tmp_path_factory, smollm_tokenizer):
    """A tiny random model with the target's tokenizer and other weights: its drafts are wrong."""
    from eyas.engine.target import load_target

    folder = build_tiny_model(tmp_path_factory.mktemp("stranger"), smollm_tokenizer, seed=1)
    return load_target(str(folder), dtype="float32")


def test_drafts_that_never_match_fall_back_to_plain_with_plain_output(tiny_target, stranger_draft):
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = generate(tiny_target, PROMPT, params).token_ids
    proposer = DraftModelProposer(stranger_draft, priced=True)
    # the 1.5B pair's prices, frozen (the tiny models' own timings would move them): a draft a
    # third of the target pays at the prior and while exploring; only acceptance can rule it out
    proposer.pricing = FrozenPricing(TARGET, draft_pass=1 / 3, explore_steps=2)
    result = speculative_generate(tiny_target, PROMPT, params, proposer, 4)
    spec = result.stats["speculative"]
    assert result.token_ids == plain
    assert spec["accepted_tokens"] <= 1
    # the two exploring steps; then (1 + 0.47) / (1.19 + 1 / 3) < 1: plain, but for a probe
    # when the misses have decayed toward the prior (~every 10 steps) or after 16 plain steps
    assert 2 < spec["verification_steps"] <= 8
    assert spec["plain_steps"] >= 35


def test_a_draft_that_cannot_pay_is_never_run(tiny_target, tmp_path, smollm_tokenizer):
    """single_stream prices the draft from its own measured pass: a draft eight times the
    target's width cannot pay, so it neither prefills nor drafts; the output is plain's."""
    from eyas.engine.target import load_target

    folder = build_tiny_model(tmp_path, smollm_tokenizer, seed=2, hidden_size=512, intermediate_size=1024)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = generate(tiny_target, PROMPT, params).token_ids
    proposer = DraftModelProposer(load_target(str(folder), dtype="float32"), priced=True)
    result = speculative_generate(tiny_target, PROMPT, params, proposer, 4)
    assert result.token_ids == plain
    assert result.stats["speculative"]["verification_steps"] == 0
    assert proposer.cached_ids == []  # no prefill of the draft either


def test_a_vocabulary_subset_drafts_its_own_argmax_and_output_stays_plain(tiny_target, stranger_draft):
    """Greedy drafts over the first 16384 ids + the special tokens: the subset's exact argmax;
    greedy output equals plain with the target as its own draft and with a stranger."""
    import torch

    from eyas.engine.speculative.proposers.draft_vocabulary import DraftVocabulary
    from spec_checks import assert_greedy_equals_plain

    vocabulary = DraftVocabulary.build(tiny_target, 16384)
    assert vocabulary is not None and DraftVocabulary.build(tiny_target, 32768) is None
    assert set(tiny_target.tokenizer.all_special_ids) <= set(vocabulary.ids.tolist())
    # padded with the next ids to whole blocks of 16 rows: the extension's screen, where the
    # whole output layer's runs there (PyTorch's costs more than the whole vocabulary's)
    assert len(vocabulary.ids) % 16 == 0 and vocabulary.ids.tolist()[:16384] == list(range(16384))
    assert vocabulary.screened_in_extension == bool(tiny_target.model.lm_head.int8dot)
    hidden = torch.randn(8, tiny_target.config.hidden_size)
    with torch.inference_mode():
        full = tiny_target.model.lm_head(hidden)  # [8, V]
    ids = vocabulary.ids
    expected = ids[full[:, ids].argmax(dim=-1)].tolist()
    assert [vocabulary.token(int(i)) for i in vocabulary.logits(hidden).argmax(dim=-1)] == expected
    proposer = DraftModelProposer(tiny_target, vocabulary_size=16384)
    totals = assert_greedy_equals_plain(tiny_target, [PROMPT], proposer, 4, 24)
    assert totals["draft_tokens"] > 0
    stranger = DraftModelProposer(stranger_draft, vocabulary_size=16384)
    assert_greedy_equals_plain(tiny_target, [PROMPT], stranger, 4, 24)


def test_a_draft_priced_out_by_a_busy_moment_is_probed_again():
    pricing = ChainPricing(TARGET, draft_pass=0.3, explore_steps=0)
    pricing.measured("draft", 1.5, 0.3)  # one draft pass measured at 1.5 target passes
    assert not pricing.could_pay(4)
    assert [pricing.length(4) for _ in range(17)] == [0] * 16 + [4]


def test_the_target_as_its_own_draft_is_priced_out_only_with_the_fallback_on(tiny_target):
    """`self` (and `layerskip`) are priced like a draft model: a draft pass as dear as a
    target pass never pays, so with the never-slower fallback on nothing is drafted; with it
    off (`eyas eval`'s default) every step drafts, so the method itself is measured."""
    from eyas.engine.speculative.methods import build_proposer
    from eyas.engine.speculative.policy import PolicyConfig

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = generate(tiny_target, PROMPT, params).token_ids
    proposer = build_proposer("self", tiny_target)
    assert proposer.priced
    proposer.pricing = FrozenPricing(TARGET, draft_pass=1.0)  # its measured price, without the noise
    priced = speculative_generate(tiny_target, PROMPT, params, proposer, 4)
    assert priced.token_ids == plain
    assert priced.stats["speculative"]["verification_steps"] == 0
    always = speculative_generate(tiny_target, PROMPT, params, proposer, 4, policy=PolicyConfig(enabled=False))
    assert proposer.pricing is None
    assert always.token_ids == plain
    assert always.stats["speculative"]["accepted_tokens"] == always.stats["speculative"]["draft_tokens"] > 0


def test_a_skipping_draft_is_first_priced_by_the_layers_it_runs(tmp_path, smollm_tokenizer):
    from eyas.engine.speculative.methods import build_proposer
    from eyas.engine.speculative.sizing import load_or_measure
    from eyas.engine.target import load_target

    target = load_target(str(build_tiny_model(tmp_path, smollm_tokenizer, num_hidden_layers=4)), dtype="float32")
    proposer = build_proposer("layerskip:1", target)
    proposer.single_stream(target)
    full = load_or_measure(target, sizes=(1, 2)).verify(1)
    assert proposer.pricing.draft_pass == pytest.approx(full * 3 / 4)
    proposer.single_stream(target, fallback=False)
    assert proposer.pricing is None


def test_a_vocabulary_subset_is_padded_with_the_lowest_missing_ids():
    import numpy as np

    from eyas.engine.speculative.proposers.draft_vocabulary import padded

    assert padded(np.array([0, 1, 2, 100]), 200).tolist() == list(range(15)) + [100]
    assert padded(np.arange(32), 200).tolist() == list(range(32))
    assert padded(np.array([0, 5]), 4).tolist() == [0, 1, 2, 3, 5]  # the vocabulary has no more


def test_acceptance_learned_on_earlier_requests_starts_a_new_request_in_plain_steps():
    """Chains that missed on earlier requests are remembered across requests: a new request
    neither reads its prompt with the draft nor explores, and plain steps do not decay the
    request's evidence back to the optimistic prior (they decay toward the learned rates)."""
    pricing = ChainPricing(TARGET, draft_pass=1 / 3, explore_steps=1)
    pricing.measured("draft", 1 / 3, 1 / 3)
    assert pricing.new_request(4) and pricing.length(4) == 4  # never seen: trusted, explores
    for _ in range(30):  # the pair's chains miss at their first token
        pricing.record(4, 0)
        pricing.relax()
    assert pricing.history.rate(0) < 0.15 and pricing.acceptance.prior[0] == pricing.history.rate(0)
    for _ in range(200):  # plain steps: the request's evidence decays toward the learned rates
        pricing.relax()
    assert pricing.best_length(4) == 0
    assert not pricing.new_request(4) and pricing.length(4) == 0
    fresh = ChainPricing(TARGET, draft_pass=1 / 3, explore_steps=1)  # the fixed prior alone pays
    fresh.measured("draft", 1 / 3, 1 / 3)
    assert fresh.best_length(4) > 0 and fresh.new_request(4)
    for _ in range(60):  # the text turned predictable: the learned rates follow
        pricing.record(4, 4)
    assert pricing.history.rate(0) > 0.8 and pricing.new_request(4) and pricing.length(4) == 4


def test_a_request_that_starts_plain_from_a_learned_prior_gives_plain_output(tiny_target, stranger_draft):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = generate(tiny_target, PROMPT, params).token_ids
    proposer = DraftModelProposer(stranger_draft, priced=True, catch_up_window=16)
    proposer.pricing = FrozenPricing(TARGET, draft_pass=1 / 3, explore_steps=2)
    proposer.pricing.ratios["draft"] = 1.0  # measured: the prices are trusted
    first = speculative_generate(tiny_target, PROMPT, params, proposer, 4)
    assert first.token_ids == plain and first.stats["speculative"]["verification_steps"] >= 2
    assert proposer.pricing.history.rate(0) < 0.5  # learned from the first request's misses
    second = speculative_generate(tiny_target, PROMPT, params, proposer, 4)
    assert second.token_ids == plain
    spec = second.stats["speculative"]
    assert spec["verification_steps"] <= 2 and spec["plain_steps"] >= 37  # at most the probes
    # the draft never read the prompt whole: a probe's catch-up is the last 16 tokens
    assert proposer.offset > 0 if spec["verification_steps"] else proposer.cached_ids == []


def test_steps_are_priced_in_the_threads_cpu_seconds_not_in_waits(tiny_target):
    """A step's price is this thread's CPU time since the last step ended: a wait for a core
    (here a sleep) and the wall seconds the engine reports are not charged to it."""
    import time

    proposer = DraftModelProposer(tiny_target, priced=True)
    proposer.pricing = ChainPricing(TARGET, draft_pass=1 / 3)  # verify(1) priced at 1 s
    proposer.after_prefill, proposer.step_clock = False, time.thread_time()
    time.sleep(0.3)
    started = time.thread_time()
    while time.thread_time() - started < 0.05:  # 50 ms of work
        pass
    proposer.step_seconds(0, 5.0)
    assert 0.05 <= proposer.pricing.ratios["plain"] < 0.15


def test_a_chain_that_pays_a_little_starts_a_request_without_the_drafts_prefill():
    """Priced at less than start_margin over plain, a request neither explores nor has the
    draft read its prompt; the chain that pays is still drafted (from a window of the context)."""
    marginal = settled(0.6, 1 / 3)
    marginal.measured("draft", 1 / 3, 1 / 3)
    assert 1.0 < marginal.speed_up(4) < marginal.start_margin  # 1.6 / (1.19 + 1 / 3) = 1.05
    assert not marginal.new_request(4) and marginal.length(4) == 1
    clear = settled(0.9, 1 / 3)
    clear.measured("draft", 1 / 3, 1 / 3)
    assert clear.speed_up(4) > clear.start_margin and clear.new_request(4) and clear.length(4) == 4
    assert settled(0.3, 1 / 3).speed_up(4) == 1.0
    with pytest.raises(ValueError, match="start_margin"):
        ChainPricing(TARGET, 1 / 3, start_margin=0.9)


def test_an_exploring_pair_reads_no_prompt_and_its_first_chain_reads_a_window(tiny_target):
    """A request that explores (a pair never measured is trusted) still leaves the prompt
    unread at begin; its first chain restarts the draft's cache from the last
    `catch_up_window` tokens, and drafts the model's own continuation of those alone."""
    import torch

    proposer = DraftModelProposer(tiny_target, priced=True, catch_up_window=8)
    proposer.pricing = ChainPricing(TARGET, draft_pass=1 / 3)
    proposer.begin(tiny_target, PROMPT, SamplingParams())
    assert proposer.pricing.explored < proposer.pricing.explore_steps  # it explores
    assert proposer.cached_ids == [] and proposer.offset == 0
    tree = proposer.propose(PROMPT, 3)
    assert tree.size == 3 and proposer.offset == len(PROMPT) - 8
    drafts = tree.tokens.tolist()
    assert proposer.cached_ids == PROMPT[-8:] + drafts[:2]
    with torch.inference_mode():
        expected = tiny_target.model(torch.tensor([PROMPT[-8:] + drafts[:2]])).logits[0, -3:].argmax(-1).tolist()
    assert drafts == expected
