"""Hand-built trees (masks, positions, paths) and forced-argmax acceptance cases."""

from __future__ import annotations

import torch

from eyas.engine.speculative.acceptance import accept_greedy
from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.tree import node_depths, tree_mask

VOCAB = 10


def tree(tokens, parents):
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


# A tree:      root
#             /    \
#         1:a=5    2:b=6
#          /   \      \
#     3:c=7   4:d=8   5:e=9
#       |
#     6:f=4
EXAMPLE = tree([5, 6, 7, 8, 9, 4], [0, 0, 1, 1, 2, 3])


def forced_logits(choices: list[int]) -> torch.Tensor:
    """Logits [len(choices), VOCAB] whose argmax in row i is choices[i]."""
    logits = torch.zeros(len(choices), VOCAB)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


def test_tree_mask_rows_are_ancestors_and_self():
    expected = torch.tensor([
        # r  1  2  3  4  5  6
        [1, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0],  # 1
        [1, 0, 1, 0, 0, 0, 0],  # 2
        [1, 1, 0, 1, 0, 0, 0],  # 3
        [1, 1, 0, 0, 1, 0, 0],  # 4
        [1, 0, 1, 0, 0, 1, 0],  # 5
        [1, 1, 0, 1, 0, 0, 1],  # 6
    ], dtype=torch.bool)
    assert torch.equal(tree_mask(EXAMPLE), expected)


def test_positions_and_full_mask_include_the_context():
    from eyas.scheduler.batch import RowInput, build_decode_batch

    batch = build_decode_batch([RowInput(0, 4, 3, EXAMPLE)])  # one row: the tree's own pass
    ids, positions, mask = batch.input_ids, batch.positions, batch.attn_mask
    assert ids.tolist() == [[3, 5, 6, 7, 8, 9, 4]]
    assert positions.tolist() == [[4, 5, 5, 6, 6, 6, 7]]
    assert batch.pass_arguments()["write_at"] == 4
    assert node_depths(EXAMPLE) == [1, 1, 2, 2, 2, 3]
    assert mask.shape == (1, 7, 11)
    assert bool(mask[0, :, :4].all())  # everyone sees the context
    assert torch.equal(mask[0, :, 4:], tree_mask(EXAMPLE))


def test_chain_is_a_tree_whose_mask_is_causal():
    chain = DraftTree.chain([1, 2, 3])
    assert chain.is_chain and not EXAMPLE.is_chain
    assert torch.equal(tree_mask(chain), torch.ones(4, 4, dtype=torch.bool).tril())


def test_all_accepted_gives_the_bonus_token():
    # root -> 5 (node 1) -> 7 (node 3) -> 4 (node 6) -> bonus 2
    choices = [5, 7, 0, 4, 0, 0, 2]
    result = accept_greedy(EXAMPLE, forced_logits(choices))
    assert result.accepted_nodes == [1, 3, 6] and result.accepted_tokens == [5, 7, 4]
    assert result.next_token == 2 and result.is_bonus and result.emitted == [5, 7, 4, 2]


def test_first_draft_rejected_gives_the_recovered_token():
    choices = [3, 0, 0, 0, 0, 0, 0]  # target wants 3; root's children are 5 and 6
    result = accept_greedy(EXAMPLE, forced_logits(choices))
    assert result.accepted_nodes == [] and result.emitted == [3] and not result.is_bonus


def test_second_sibling_accepted_then_rejection_mid_path():
    choices = [6, 0, 1, 0, 0, 0, 0]  # root -> 6 (node 2); node 2 wants 1 but its child is 9
    result = accept_greedy(EXAMPLE, forced_logits(choices))
    assert result.accepted_nodes == [2] and result.emitted == [6, 1] and not result.is_bonus


def test_empty_draft_is_a_plain_step():
    result = accept_greedy(DraftTree.empty(), forced_logits([4]))
    assert result.accepted_nodes == [] and result.emitted == [4] and result.is_bonus


def test_truncation_keeps_a_connected_prefix():
    assert EXAMPLE.truncated(3).tokens.tolist() == [5, 6, 7]
    assert EXAMPLE.truncated(3).parents.tolist() == [0, 0, 1]
