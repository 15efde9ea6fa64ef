"""Priced prompt lookup (proposers/ngram.py): the draft is cut where expected tokens per second
peak under measured verification costs, from the acceptance observed per matched n-gram length."""

from types import SimpleNamespace

from eyas.engine.speculative.proposers.ngram import NgramConfig, NgramProposer
from eyas.engine.speculative.sizing import CostModel

# "a b c d e f a b c" -> the 3-gram "a b c" matched; its continuation is "d e f a b c"
TOKENS = [11, 12, 13, 14, 15, 16, 11, 12, 13]
CHEAP = CostModel({1: 1.0, 2: 1.01, 4: 1.03, 8: 1.07, 16: 1.15})  # verifying more is ~free
STEEP = CostModel({1: 1.0, 2: 1.5, 4: 2.5, 8: 4.5, 16: 8.5})  # each token costs half a step


def priced(cost: CostModel) -> NgramProposer:
    proposer = NgramProposer(NgramConfig(max_n=3, min_n=1, priced=True))
    proposer.use_costs(cost)
    proposer.single_stream(None)  # costs already set: nothing measured
    return proposer


def step(proposer: NgramProposer, accepted: int) -> list[int]:
    """Propose, then report `accepted` of the drafted chain as accepted; the drafted tokens."""
    tree = proposer.propose(TOKENS, 8)
    accepted = min(accepted, tree.size)
    proposer.observe(tree, SimpleNamespace(accepted_nodes=list(range(1, accepted + 1))), None)
    return tree.tokens.tolist()


def test_cheap_verification_drafts_the_whole_continuation_as_a_chain():
    proposer = priced(CHEAP)
    tree = proposer.propose(TOKENS, 8)
    assert tree.tokens.tolist() == [14, 15, 16, 11, 12, 13]
    assert tree.parents.tolist() == [0, 1, 2, 3, 4, 5]  # a chain under the root


def test_steep_verification_drafts_only_what_the_statistics_pay_for():
    proposer = priced(STEEP)
    # prior: 0.4 for the first token, 0.6 after: (1 + 0.4) / 1.5 < 1, so a plain step
    assert proposer.propose(TOKENS, 8).size == 0
    stats = proposer.branches[3]
    for _ in range(20):  # the 3-gram's continuations were right, every token of them
        stats.record(6, 6)
    assert stats.rate(0) == 0.9 and round(stats.rate(1), 4) == 0.9333
    # expected tokens / cost for L = 1..6: 1.9/1.5, 2.74/2, 3.52/2.5, 4.26/3 (best), 4.94/3.5, ...
    assert proposer.propose(TOKENS, 8).tokens.tolist() == [14, 15, 16, 11]


def test_observe_records_accepted_tokens_against_the_matched_length():
    proposer = priced(CHEAP)
    assert step(proposer, accepted=2) == [14, 15, 16, 11, 12, 13]
    stats = proposer.branches[3]
    # 2 accepted of 6 (then relaxed once by 0.99): hits [1, 1, 0..], trials [1, 1, 1, 0..]
    assert [round(h, 4) for h in stats.hits[:3]] == [0.99, 0.99, 0.0]
    assert [round(t, 4) for t in stats.trials[:4]] == [0.99, 0.99, 0.99, 0.0]
    assert all(t == 0 for t in proposer.branches[1].trials)  # other lengths untouched


def test_a_proposer_never_handed_costs_drafts_as_before():
    """The serving engine never calls single_stream: its steps are priced by the serving rule."""
    proposer = NgramProposer(NgramConfig(max_n=3, min_n=1, max_matches=2, priced=True))
    tree = proposer.propose(TOKENS, 4)
    assert tree.tokens.tolist() == [14, 15, 16, 11]


def test_priced_ngram_on_the_int4_target_equals_plain_and_drafts(smollm_int4_target,
                                                                 mtbench_prompt_ids):
    from spec_checks import assert_greedy_equals_plain
    from eyas.engine.generate import generate
    from eyas.engine.sampling import SamplingParams

    target, prompts = smollm_int4_target, mtbench_prompt_ids[:3]
    params = SamplingParams(max_tokens=48)
    expected = [generate(target, prompt, params).token_ids for prompt in prompts]
    proposer = NgramProposer(NgramConfig(max_n=3, min_n=1, priced=True))
    proposer.use_costs(CHEAP)  # kept: speculative_generate measures costs only where none are set
    totals = assert_greedy_equals_plain(target, prompts, proposer, 6, 48, expected)
    assert totals["draft_tokens"] > 0
