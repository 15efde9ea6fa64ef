"""`X+ngram`: the prompt-lookup branch merged into a head's tree, and the head's rank statistics
kept to the nodes it drafted."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.speculative.draft import DraftTree, VerifyResult
from eyas.engine.speculative.methods import build_proposer, split_graft
from eyas.engine.speculative.proposers.eagle3 import Eagle3Proposer
from eyas.engine.speculative.proposers.graft import NgramGraftProposer, graft_branch
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
