"""`X+suffix`: the suffix tree merged into a head's tree, every node priced on one scale (its
probability of lying on the accepted path), the head told its nodes' new numbers."""

from __future__ import annotations

import copy

import torch

from eyas.engine.speculative.draft import DraftTree, VerifyResult
from eyas.engine.speculative.proposers.eagle3 import Eagle3Proposer
from eyas.engine.speculative.proposers.suffix import SuffixConfig, SuffixProposer
from eyas.engine.speculative.proposers.suffix_candidates import Confidence
from eyas.engine.speculative.proposers.suffix_graft import SuffixGraftProposer
from eyas.engine.speculative.sizing import CostModel, RankStats, TreeChoice

CERTAIN = (1.0,) * 8


class TwoNodeHead:
    """A main proposer drafting root -> 999 (rank 1) -> 998 (rank 1), priced like EAGLE-3 in
    auto mode, with rank-1 probability `rank1`."""

    name, tap_layers, auto = "head", (), True

    def __init__(self, verify_seconds: dict[int, float], rank1: float) -> None:
        self.cost = CostModel(verify_seconds, {1: 0.0})
        self.choice = TreeChoice(2, 1, 3, 1.5, 0.0, 0.0)
        self.ranks = RankStats(max_rank=1, prior_weight=1.0)
        self.ranks.counts = [rank1]
        self.node_ranks: list[int] = []

    def propose(self, token_ids, max_nodes):
        self.node_ranks = [1, 1]
        return DraftTree(torch.tensor([999, 998]), torch.tensor([0, 1]))

    renumber = Eagle3Proposer.renumber

    def draft_seconds(self, max_nodes):
        return 0.0

    def expected_tokens(self, max_nodes):
        return 1.0 + sum(self.ranks.probabilities[0] ** d for d in range(1, min(max_nodes, 2) + 1))

    def observe(self, tree, result, output):
        pass


def suffix_with(prompt: list[int]) -> SuffixProposer:
    proposer = SuffixProposer(SuffixConfig(cache_mb=0, max_depth=8, max_match=4, priced=False))
    proposer.confidence["local"] = Confidence(prior=CERTAIN)
    proposer.begin(None, prompt, None)
    return proposer


PROMPT = [1, 2, 3, 4, 5, 1, 2]  # "1 2" was followed by 3 4 5 1 2: the suffix tree is that chain
FLAT = {1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0104, 16: 0.011}
STEEP = {1: 0.010, 2: 0.013, 3: 0.016, 4: 0.030, 8: 0.060, 16: 0.12}


def test_a_flat_curve_verifies_both_sources_and_the_head_keeps_its_numbering():
    head = TwoNodeHead(FLAT, rank1=0.5)
    graft = SuffixGraftProposer(head, suffix_with(PROMPT))
    drafted = graft.propose(PROMPT, 8)
    assert drafted.tokens.tolist() == [999, 998, 3, 4, 5, 1, 2]
    assert drafted.parents.tolist() == [0, 1, 0, 3, 4, 5, 6]
    assert head.node_ranks == [1, 1, 0, 0, 0, 0, 0]
    # accepted 3, 4: the suffix confidence records three hit-or-miss trials (3 and 4 hit, 5 missed)
    before = sum(graft.suffix.confidence["local"].hits)
    graft.observe(drafted, VerifyResult([3, 4], [3, 4], 7, False), None)
    assert sum(graft.suffix.confidence["local"].hits) - before == 2 * 0.995  # relaxed once


def test_a_steep_curve_spends_the_budget_on_the_likelier_source():
    # the suffix chain is certain (probability 1 each), the head's nodes 0.3 and 0.09: with
    # verification this steep (a 4th token costs as much as the first three) two suffix nodes
    # win, (1 + 2) / verify(3) > (1 + 3) / verify(4), and the head's nodes are dropped
    head = TwoNodeHead(STEEP, rank1=0.3)
    graft = SuffixGraftProposer(head, suffix_with(PROMPT))
    drafted = graft.propose(PROMPT, 8)
    assert drafted.tokens.tolist() == [3, 4]
    assert drafted.parents.tolist() == [0, 1]
    assert head.node_ranks == [0, 0]  # the head's nodes were left out


def test_a_node_both_sources_propose_is_shared_and_keeps_the_larger_probability():
    head = TwoNodeHead(FLAT, rank1=0.2)
    prompt = [1, 2, 999, 7, 1, 2]  # the suffix proposes 999 -> 7 -> 1 -> 2 after "1 2"
    graft = SuffixGraftProposer(head, suffix_with(prompt))
    drafted = graft.propose(prompt, 8)
    assert drafted.tokens.tolist() == [999, 998, 7, 1, 2]
    assert drafted.parents.tolist() == [0, 1, 1, 3, 4]
    assert graft._nodes[0] is not None and graft._nodes[0].probability == 1.0  # shared node


def test_the_serving_price_takes_the_best_split_and_copies_share_the_store():
    head = TwoNodeHead(FLAT, rank1=0.2)
    graft = SuffixGraftProposer(head, suffix_with(PROMPT))
    graft.propose(PROMPT, 3)
    # budget 3: the suffix chain (3 x 1.0) beats the head (0.2 + 0.04)
    assert graft.expected_tokens(3) == 4.0
    twin = copy.copy(graft)
    assert twin.main is not graft.main and twin.suffix is not graft.suffix
    assert twin.suffix.store is graft.suffix.store and twin.name == "head+suffix"
