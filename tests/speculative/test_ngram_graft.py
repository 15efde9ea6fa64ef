"""`X+ngram`: the prompt-lookup branch merged into a head's tree, and the head's rank statistics
kept to the nodes it drafted."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.speculative.draft import DraftTree, VerifyResult
from eyas.engine.speculative.methods import build_proposer, split_graft
from eyas.engine.speculative.proposers.eagle3 import Eagle3Proposer
from eyas.engine.speculative.proposers.graft import BranchStats, NgramGraftProposer, graft_branch
from eyas.engine.speculative.sizing import RankStats
from eyas.errors import EyasError


def tree(tokens, parents) -> DraftTree:
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def test_the_branch_shares_the_nodes_where_it_agrees_and_adds_the_rest():
    # root -> 10 (1) -> 11 (3); root -> 20 (2)
    base = tree([10, 20, 11], [0, 0, 1])
    merged, node_map = graft_branch(base, [10, 11, 12, 13], max_nodes=8)
    assert node_map == [1, 2, 3]
    assert merged.tokens.tolist() == [10, 20, 11, 12, 13]
    assert merged.parents.tolist() == [0, 0, 1, 3, 4]
    # a branch that leaves the tree at the root
    merged, _ = graft_branch(base, [30, 31], max_nodes=8)
    assert merged.tokens.tolist() == [10, 20, 11, 30, 31]
    assert merged.parents.tolist() == [0, 0, 1, 0, 4]


def test_the_budget_cuts_the_branch_and_a_covered_branch_changes_nothing():
    base = tree([10, 20, 11], [0, 0, 1])
    merged, _ = graft_branch(base, [10, 11, 12, 13], max_nodes=4)
    assert merged.tokens.tolist() == [10, 20, 11, 12]
    assert merged.parents.tolist() == [0, 0, 1, 3]
    same, node_map = graft_branch(base, [10, 11], max_nodes=8)
    assert same is base and node_map == [1, 2, 3]
    empty, node_map = graft_branch(DraftTree.empty(), [7, 8], max_nodes=8)
    assert empty.tokens.tolist() == [7, 8] and empty.parents.tolist() == [0, 1] and node_map == []


def ranks_after(node_ranks, merged: DraftTree, accepted: list[int]) -> list[float]:
    """The rank counts an EAGLE-3 proposer records for one verification of `merged`."""
    proposer = object.__new__(Eagle3Proposer)
    proposer.ranks = RankStats(max_rank=2, prior_weight=0.0)
    proposer.node_ranks = node_ranks
    proposer.auto = False
    tokens = merged.tokens.tolist()
    result = VerifyResult(accepted, [tokens[n - 1] for n in accepted], 0, False)
    proposer._record_ranks(merged, result)
    return proposer.ranks.counts + [proposer.ranks.total]


def test_the_head_records_ranks_only_where_it_drafted():
    # head tree: root -> 10 (rank 1), 20 (rank 2); 10 -> 11 (rank 1). Grafted: 11 -> 12 -> 13.
    base = tree([10, 20, 11], [0, 0, 1])
    merged, node_map = graft_branch(base, [10, 11, 12, 13], max_nodes=8)
    proposer = object.__new__(Eagle3Proposer)
    proposer.node_ranks = [1, 2, 1]
    proposer.renumber(node_map, merged.size)
    assert proposer.node_ranks == [1, 2, 1, 0, 0]
    # accepted 10, 11 (head's), then 12, 13 (grafted): ranks 1, 1; no miss (11 had no head child)
    assert ranks_after([1, 2, 1, 0, 0], merged, [1, 3, 4, 5]) == [2, 0, 2]
    # accepted 10 only: rank 1, then a miss under 10
    assert ranks_after([1, 2, 1, 0, 0], merged, [1]) == [1, 0, 2]
    # nothing accepted: a miss at depth 1
    assert ranks_after([1, 2, 1, 0, 0], merged, []) == [0, 0, 1]
    # a grafted node under the root accepted: the head's depth-1 children missed
    other, node_map = graft_branch(base, [30, 31], max_nodes=8)
    assert ranks_after([1, 2, 1, 0, 0], other, [4, 5]) == [0, 0, 1]


def test_graft_specs_parse_and_bad_ones_say_what_is_accepted(tiny_target):
    assert split_graft("eagle3:runs/head+ngram") == ("eagle3:runs/head", "")
    assert split_graft("eagle3:runs/head+ngram:3,1,6") == ("eagle3:runs/head", "3,1,6")
    assert split_graft("eagle3:runs/a+ngramx") == ("eagle3:runs/a+ngramx", None)
    assert split_graft("ngram") == ("ngram", None)
    with pytest.raises(EyasError, match="needs a method to graft onto"):
        build_proposer("none+ngram", tiny_target)
    with pytest.raises(EyasError, match="cannot take it"):
        build_proposer("ngram:3+ngram", tiny_target)
    with pytest.raises(EyasError, match="GRAFT_TOKENS"):
        NgramGraftProposer(object.__new__(Eagle3Proposer), max_n=2, min_n=3)


def test_each_request_gets_its_own_main_proposer():
    import copy

    main = object.__new__(Eagle3Proposer)
    main.name, main.tap_layers = "eagle3", (1, 2, 3)
    graft = NgramGraftProposer(main)
    twin = copy.copy(graft)
    assert twin.main is not graft.main and twin.tap_layers == (1, 2, 3)
    assert twin.name == "eagle3+ngram"


class FixedTreeProposer:
    """A main proposer that drafts one node (rank 1) and prices like EAGLE-3 in auto mode."""

    name, tap_layers, auto = "fixed", (), True

    def __init__(self, verify_seconds: dict[int, float], tokens=(999,), ranks=(1,)) -> None:
        from eyas.engine.speculative.sizing import CostModel, TreeChoice

        self.tokens, self.drafted_ranks = list(tokens), list(ranks)
        self.cost = CostModel(verify_seconds, {1: 0.001})
        self.choice = TreeChoice(1, 1, 2, 1.5, verify_seconds[2] + 0.001, 0.0)
        self.ranks = RankStats()
        self.node_ranks: list[int] = []
        self.observed: list = []

    def propose(self, token_ids, max_nodes):
        self.node_ranks = list(self.drafted_ranks)
        return tree(self.tokens, [0] * len(self.tokens))

    renumber = Eagle3Proposer.renumber

    def draft_seconds(self, max_nodes):  # one level of one row, as Eagle3Proposer prices it
        return self.cost.tree_draft(min(self.choice.depth, max_nodes), self.choice.top_k)

    def observe(self, tree, result, output):
        self.observed.append(result)


REPEATING = [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 5, 6, 7]  # "5 6 7" seen before: continue 8 9 10 11


def test_a_flat_verification_curve_keeps_the_whole_branch():
    flat = {1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0104, 16: 0.011}
    graft = NgramGraftProposer(FixedTreeProposer(flat), graft_tokens=4)
    drafted = graft.propose(REPEATING, 8)
    assert drafted.tokens.tolist() == [999, 8, 9, 10, 11]
    assert drafted.parents.tolist() == [0, 0, 2, 3, 4]


def test_a_steep_curve_cuts_the_branch_and_acceptance_lengthens_it_again():
    steep = {1: 0.010, 2: 0.013, 3: 0.0135, 4: 0.020, 8: 0.024, 16: 0.05}  # a jump past 3 tokens
    main = FixedTreeProposer(steep)
    graft = NgramGraftProposer(main, graft_tokens=4)
    assert graft.propose(REPEATING, 8).tokens.tolist() == [999, 8]  # only what 3 tokens allow
    # a branch that keeps being accepted in full: four new nodes become worth the jump
    three_gram = graft.branches[3]  # REPEATING matches "5 6 7"
    for _ in range(40):
        three_gram.record(drafted=4, accepted=4)
    drafted = graft.propose(REPEATING, 8)
    assert drafted.tokens.tolist() == [999, 8, 9, 10, 11]
    # the verification result reaches the statistics: 2 of the 4 new nodes accepted
    before = list(three_gram.trials)
    graft.observe(drafted, VerifyResult([2, 3], [8, 9], 0, False), None)
    assert [t - b for t, b in zip(three_gram.trials, before)] == [1, 1, 1, 0]
    assert main.observed[-1].accepted_nodes == [2, 3]


def test_branch_statistics_count_each_node_given_the_one_before():
    stats = BranchStats(3, prior=(0.5, 0.5), weight=2.0)
    stats.record(drafted=3, accepted=1)  # node 1 accepted, node 2 rejected, node 3 not reached
    stats.record(drafted=2, accepted=2)
    assert stats.hits == [2.0, 1.0, 0.0] and stats.trials == [2.0, 2.0, 0.0]
    assert [stats.rate(j) for j in range(3)] == pytest.approx([0.75, 0.5, 0.5])  # (hits + 1) / (trials + 2)
    for _ in range(500):  # unused, the evidence fades and the prior returns
        stats.relax()
    assert stats.rate(0) == pytest.approx(0.5, abs=0.01) and stats.rate(3) == 0.0


def test_each_matched_ngram_length_keeps_its_own_statistics():
    flat = {1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0104, 16: 0.011}
    graft = NgramGraftProposer(FixedTreeProposer(flat), max_n=3, min_n=1, graft_tokens=4)
    rejected = VerifyResult([], [], 0, False)  # nothing accepted: one failed trial of node 1
    graft.observe(graft.propose(REPEATING, 8), rejected, None)  # "5 6 7" matched
    assert graft.branches[3].trials[0] == 1 and graft.branches[1].trials[0] == 0
    graft.observe(graft.propose([1, 2, 3, 4, 5, 2], 8), rejected, None)  # only "2" matched
    assert graft.branches[1].trials[0] == 1 and graft.branches[3].trials[0] == pytest.approx(0.99)


def test_a_reliable_branch_displaces_the_heads_weaker_guess():
    steep = {1: 0.010, 2: 0.013, 3: 0.0135, 4: 0.020, 8: 0.024, 16: 0.05}
    main = FixedTreeProposer(steep, tokens=(999, 998), ranks=(1, 2))  # P 0.55 and 0.12
    graft = NgramGraftProposer(main, graft_tokens=4)
    assert graft.propose(REPEATING, 8).tokens.tolist() == [999, 8]  # 8 (0.4) beats 998 (0.12)
    assert main.node_ranks == [1, 0]  # the head's rank-2 node was left out
    assert graft.grafted == 1


class PricedFixedTree(FixedTreeProposer):
    """FixedTreeProposer that also prices its one-node tree (as EAGLE-3 does for serving)."""

    def expected_tokens(self, max_nodes):
        return 1.0 + self.ranks.probabilities[0]

    def draft_seconds(self, max_nodes):
        return 0.001


def test_the_serving_price_splits_the_budget_between_the_head_and_a_branch_that_matches():
    import copy

    flat = {1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0104, 16: 0.011}
    main = PricedFixedTree(flat)
    graft = NgramGraftProposer(main, graft_tokens=4)
    assert graft.expected_tokens(8) == main.expected_tokens(8)  # nothing matched yet
    assert graft.draft_seconds(8) == 0.001
    drafted = graft.propose(REPEATING, 8)  # "5 6 7" matched: the whole branch kept
    assert drafted.size == 5
    assert graft.match_rate == pytest.approx(0.2) and graft.last_n == 3
    rates = [graft.branches[3].rate(j) for j in range(4)]
    on_path, branch = 1.0, []
    for rate in rates:
        on_path *= rate
        branch.append(0.2 * on_path)
    head = main.expected_tokens(1)
    # k nodes: the head's k - b (its price for any k >= 1 is `head`) or none (1.0), plus b of the branch
    assert graft.expected_tokens(1) == pytest.approx(max(head, 1.0 + branch[0]))
    assert graft.expected_tokens(3) == pytest.approx(head + sum(branch[:2]))
    assert graft.expected_tokens(8) == pytest.approx(head + sum(branch))  # 4 + 4 nodes
    for _ in range(30):  # a request whose text keeps repeating: the branch is worth the budget
        graft.propose(REPEATING, 8)
    assert graft.match_rate > 0.99
    assert graft.expected_tokens(4) > graft.expected_tokens(1) + 0.3
    graft.propose([1, 2, 3, 4], 8)  # nothing matched: the rate decays
    assert graft.match_rate == pytest.approx(0.8 * (1 - 0.8 ** 31))  # 0.2, 30 hits, a miss
    twin = copy.copy(graft)  # a new request starts from the average over requests so far
    assert 0 < twin.match_rate == graft._pooled_match[0] < graft.match_rate


def test_at_a_budget_of_one_node_a_reliable_branch_takes_it_from_the_head():
    steep = {1: 0.010, 2: 0.013, 3: 0.0135, 4: 0.020, 8: 0.024, 16: 0.05}
    main = FixedTreeProposer(steep)  # one node, rank 1
    graft = NgramGraftProposer(main, graft_tokens=4)
    assert graft.propose(REPEATING, 1).tokens.tolist() == [999]  # the head's 0.55 beats 0.4
    for _ in range(40):
        graft.branches[3].record(drafted=4, accepted=4)
    drafted = graft.propose(REPEATING, 1)
    assert drafted.tokens.tolist() == [8] and drafted.parents.tolist() == [0]
    assert main.node_ranks == [0]  # the head's node was left out


class SilentProposer(FixedTreeProposer):
    """A main proposer whose sizing found no tree that pays: it drafts nothing."""

    def propose(self, token_ids, max_nodes):
        self.node_ranks = []
        return DraftTree.empty()


def test_in_single_stream_a_branch_alone_must_beat_a_plain_step():
    steep = {1: 0.010, 2: 0.016, 4: 0.026, 8: 0.046, 16: 0.09}  # each token costs 0.6 of a step
    graft = NgramGraftProposer(SilentProposer(steep), graft_tokens=4)
    # the serving engine's copies verify at least the branch's first token
    assert graft.propose(REPEATING, 8).tokens.tolist() == [8]
    graft.single_stream(None)
    # prior rate 0.4 for the first token: 1.4 tokens for 1.6 steps loses to a plain step
    assert graft.propose(REPEATING, 8).size == 0
    for _ in range(40):  # a branch that keeps being accepted in full pays for its tokens
        graft.branches[3].record(drafted=4, accepted=4)
    assert graft.propose(REPEATING, 8).tokens.tolist() == [8, 9, 10, 11]


def test_in_single_stream_an_eagle3_head_that_cannot_pay_drafts_one_step_in_sixteen():
    from eyas.engine.speculative.sizing import TreeChoice

    proposer = object.__new__(Eagle3Proposer)
    proposer.auto, proposer._unpaid_steps, proposer.step_ratios = True, 0, None
    proposer._first_step = False
    proposer.choice = TreeChoice(0, 0, 1, 1.0, 0.01, 100.0)  # the sizing's verdict: plain
    proposer.cost = None  # (no step times are kept without costs)
    drafted = []
    proposer._catch_up = lambda token_ids: drafted.append(len(token_ids))
    proposer.last_logits = None  # (so that a probe step stops right after its catch-up)
    for _ in range(32):
        proposer.propose([1, 2, 3], 4)
    assert len(drafted) == 32  # serving copies: every step is offered to the head
    proposer.single_stream(None)
    proposer.step_ratios["plain"] = 1.0  # its first plain step was measured
    drafted.clear()
    for _ in range(32):
        proposer.propose([1, 2, 3], 4)
    assert len(drafted) == 2  # steps 16 and 32
    proposer.choice = TreeChoice(1, 1, 2, 1.4, 0.0125, 112.0)  # now a chain pays
    drafted.clear()
    for _ in range(32):
        proposer.propose([1, 2, 3], 4)
    assert len(drafted) == 30  # every step but a plain one in sixteen, which re-prices plain steps


def test_single_stream_sizing_follows_the_step_times_the_loop_measured():
    """The start-up costs say a one-token chain pays; the loop's own steps say plain steps run
    20% faster than modelled and speculative ones as modelled: then plain is chosen."""
    from eyas.engine.speculative.proposers.eagle3 import TreeShape
    from eyas.engine.speculative.sizing import CostModel, RankStats

    proposer = object.__new__(Eagle3Proposer)
    proposer.auto, proposer.shape_memo, proposer.step_ratios = True, {}, None
    proposer.cost = CostModel({1: 0.010, 2: 0.0115, 4: 0.016, 8: 0.030}, {1: 0.001})
    proposer.ranks = RankStats(max_rank=2, prior_weight=0.0)
    proposer.ranks.counts, proposer.ranks.total = [0.4, 0.05], 1.0  # first guess right 40%
    proposer.shape = TreeShape(1, 1, 2)
    proposer._resize()
    assert proposer.choice.depth == 1  # 1.4 tokens for 12.5 ms beats 1 token for 10 ms
    proposer.single_stream(None)
    proposer._first_step, proposer._backlog_seconds = True, 0.0  # (begin sets them)
    assert proposer.propose([1, 2, 3], 4).size == 0  # a plain step first, to measure it
    proposer.step_seconds(0, 0.0125)  # the step right after the prefill is no price:
    assert proposer.step_ratios == {}  # its caches are cold
    assert proposer.propose([1, 2, 3], 4).size == 0  # still plain: none was priced yet
    proposer.step_seconds(0, 0.008)  # a plain step: 0.8x its modelled 10 ms
    proposer._backlog_seconds = 0.004  # its catch-up also took in the rows of plain steps:
    proposer.step_seconds(1, 0.0165)  # a one-node step as modelled (11.5 + 1 ms), plus those
    assert proposer.step_ratios == pytest.approx({"plain": 0.8, "speculative": 1.0})
    assert proposer._backlog_seconds == 0.0  # charged once
    proposer._resize()
    assert proposer.choice.depth == 0  # 1.4 tokens for 12.5 ms loses to 1 token for 8 ms
    calibrated = proposer.cost.calibrated(0.8, 1.0)
    assert calibrated.verify(1) == pytest.approx(0.008) and calibrated.verify(2) == pytest.approx(0.0115)
