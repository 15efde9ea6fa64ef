"""RadixTree: longest match, prefixes, removal on hand-made token lists."""

from __future__ import annotations

import random

import pytest

from eyas.scheduler.radix import RadixTree, common_prefix


def test_common_prefix_on_lists():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([5], [6]) == 0
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3], limit=2) == 2
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
        slow = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == slow


def test_longest_match_splits_edges_and_names_every_holder():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], "a")
    tree.insert([1, 2, 9], "b")
    tree.insert([7, 8], "c")
    assert tree.longest_match([1, 2, 3, 7]) == (3, {"a"})
    assert tree.longest_match([1, 2, 5]) == (2, {"a", "b"})
    assert tree.longest_match([1, 2, 9, 9, 9]) == (3, {"b"})
    assert tree.longest_match([7, 8, 9]) == (2, {"c"})
    assert tree.longest_match([3]) == (0, set())
    assert tree.longest_match([1]) == (1, {"a", "b"})
    assert tree.size == 3


def test_prefixes_of_finds_whole_entries_only():
    tree = RadixTree()
    tree.insert([1, 2], "short")
    tree.insert([1, 2, 3, 4], "long")
    tree.insert([1, 2, 3, 5], "other")
    assert sorted(tree.prefixes_of([1, 2, 3, 4, 6])) == ["long", "short"]
    assert tree.prefixes_of([1, 2, 3]) == ["short"]  # [1, 2, 3] ends mid-way: no entry ends there
    assert tree.prefixes_of([1]) == []


def test_remove_prunes_and_keeps_the_others():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], "a")
    tree.insert([1, 2, 9], "b")
    tree.remove([1, 2, 3, 4], "a")
    assert tree.longest_match([1, 2, 3, 4]) == (2, {"b"})
    assert tree.size == 1
    with pytest.raises(KeyError):
        tree.remove([1, 2, 3, 4], "a")
    tree.remove([1, 2, 9], "b")
    assert tree.longest_match([1, 2, 9]) == (0, set()) and tree.root.children == {}


def test_random_sequences_match_a_brute_force_search():
    rng = random.Random(1)
    tree, held = RadixTree(), {}
    for step in range(300):
        if held and rng.random() < 0.3:
            name = rng.choice(sorted(held))
            tree.remove(held.pop(name), name)
        else:
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
            name = f"e{step}"
            tree.insert(tokens, name)
            held[name] = tokens
        query = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
        best = max((common_prefix(query, t) for t in held.values()), default=0)
        holders = {n for n, t in held.items() if best and common_prefix(query, t) == best}
        assert tree.longest_match(query) == (best, holders)
        whole = {n for n, t in held.items() if query[: len(t)] == t}
        assert set(tree.prefixes_of(query)) == whole
