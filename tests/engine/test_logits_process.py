"""Logits processors are applied per tree node with the path to that node."""

import torch

from eyas.engine.logits_process import node_paths, process_tree_rows
from eyas.engine.speculative.draft import DraftTree


def test_node_paths_follow_parents():
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 0, 1, 3]))
    assert node_paths(tree) == [[], [5], [6], [5, 7], [5, 7, 8]]


def test_rows_see_the_completion_plus_their_path():
    seen = []

    def record(ids, row):
        seen.append(list(ids))
        row[ids[-1]] += 100.0  # depends on the history only
        return row

    tree = DraftTree(torch.tensor([1, 2]), torch.tensor([0, 1]))
    logits = torch.zeros(3, 4)
    out = process_tree_rows(logits, [record], [3], tree)
    assert seen == [[3], [3, 1], [3, 1, 2]]
    assert out.argmax(dim=-1).tolist() == [3, 1, 2]
    assert float(logits.abs().sum()) == 0.0  # the input is not changed


def test_no_processor_returns_the_same_tensor():
    logits = torch.randn(2, 5)
    assert process_tree_rows(logits, [], [1], DraftTree.chain([4])) is logits
