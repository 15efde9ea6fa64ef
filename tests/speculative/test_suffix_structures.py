"""`--draft suffix` structures: the depth-bounded suffix trie's counts (its Python and native
implementations, which give the same answers), the global store's memory bound and LRU
eviction, and the candidate tree proposed on a hand-made corpus."""

from __future__ import annotations

import random
import threading
import tracemalloc

import pytest

from eyas.engine.speculative.draft import VerifyResult
from eyas.engine.speculative.methods import build_proposer, split_suffix_graft
from eyas.engine.speculative.proposers.suffix import SuffixConfig, SuffixProposer
from eyas.engine.speculative.proposers.suffix_candidates import Confidence, bucket_of
from eyas.engine.speculative.proposers.suffix_store import SuffixStore
from eyas.engine.speculative.proposers.suffix_trie import (NATIVE_NODE_BYTES, NODE_BYTES, NativeSuffixTrie,
                                                            SuffixTrie, new_trie)
from eyas.errors import EyasError

CERTAIN = (1.0,) * 8  # a confidence prior of 1: probabilities are the raw count ratios


@pytest.fixture(params=["python", "native"])
def make_trie(request, monkeypatch):
    """Either implementation of the trie (SuffixStore's too, through new_trie)."""
    if request.param == "python":
        monkeypatch.setenv("EYAS_SUFFIX_NATIVE", "0")
        return SuffixTrie
    return native_trie(monkeypatch)


def native_trie(monkeypatch):
    monkeypatch.setenv("EYAS_SUFFIX_NATIVE", "1")
    if not isinstance(new_trie(4), NativeSuffixTrie):
        pytest.skip("the C++ extension is not available here")
    return new_trie


def paths(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every path of the trie with its count."""
    found, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        for token, child in trie.children(node):
            found[path + (token,)] = trie.count(child)
            stack.append((child, path + (token,)))
    return found


def naive_counts(documents: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for doc in documents:
        for start in range(len(doc)):
            for end in range(start + 1, min(start + depth, len(doc)) + 1):
                key = tuple(doc[start:end])
                counts[key] = counts.get(key, 0) + 1
    return counts


def test_trie_counts_every_substring_up_to_its_depth_and_removal_is_exact(make_trie):
    rng = random.Random(0)
    docs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    trie = make_trie(max_depth=5)
    for doc in docs:
        trie.insert(doc)
    assert paths(trie) == naive_counts(docs, 5)
    trie.remove(docs[1])
    trie.remove(docs[4])
    kept = [d for i, d in enumerate(docs) if i not in (1, 4)]
    assert paths(trie) == naive_counts(kept, 5)
    assert trie.nodes == len(naive_counts(kept, 5))
    trie.insert(docs[1])  # freed nodes are reused
    assert paths(trie) == naive_counts(kept + [docs[1]], 5)


def test_match_finds_the_longest_suffix_seen_often_enough(make_trie):
    trie = make_trie(max_depth=6)
    trie.insert([1, 2, 3, 7, 2, 3, 1, 2, 3])
    node, length = trie.match([9, 1, 2, 3], max_length=4)
    assert length == 3 and trie.count(node) == 2  # [1, 2, 3] twice
    node, length = trie.match([9, 1, 2, 3], max_length=4, min_count=3)
    assert length == 2 and trie.count(node) == 3  # [2, 3] three times
    assert trie.match([5, 6], max_length=4) == (0, 0)


def test_the_appenders_longest_suffix_is_what_match_finds(make_trie):
    """A request's own trie answers `match` from its appender's kept suffix nodes: the same
    (node, length) as walking each suffix from the root, after every token, for several depths,
    lengths and counts."""
    rng = random.Random(3)
    for depth in (4, 6, 24):
        trie = make_trie(max_depth=depth)
        appender = trie.appender()
        sequence: list[int] = []
        for _ in range(300):
            token = rng.randrange(5)
            appender.append(token)
            sequence.append(token)
            for max_length in (1, 3, 12):
                for min_count in (1, 2, 4):
                    assert appender.longest(max_length, min_count) == trie.match(sequence, max_length, min_count)


def test_the_store_stays_under_its_bound_and_evicts_the_least_recently_used(make_trie):
    rng = random.Random(1)
    docs = [[rng.randrange(1000) for _ in range(60)] for _ in range(12)]
    one_doc = SuffixStore(max_bytes=1 << 30, max_depth=8)
    one_doc.add(docs[0])
    bound = int(3.5 * one_doc.approximate_bytes)  # three documents fit, four do not
    store = SuffixStore(max_bytes=bound, max_depth=8)
    for doc in docs[:3]:
        store.add(doc)
    assert store.evictions == 0
    store.add(docs[0])  # refreshes docs[0]: docs[1] is now the least recently used
    store.add(docs[3])
    assert store.evictions == 1
    assert list(store.documents) == [tuple(d) for d in (docs[2], docs[0], docs[3])]
    for doc in docs[4:]:
        store.add(doc)
        assert store.approximate_bytes <= bound
    # what is left is exactly the last documents' trie
    left = [list(d) for d in store.documents]
    assert left == [docs[i] for i in range(12 - len(left), 12)]
    assert paths(store.trie) == naive_counts(left, 8)
    stats = store.stats()
    assert stats["documents"] == len(left) and stats["bytes"] <= stats["max_bytes"] == bound


def test_the_byte_estimate_covers_what_python_allocates():
    rng = random.Random(2)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        trie = SuffixTrie(max_depth=16)
        trie.insert([rng.randrange(40000) for _ in range(1500)])
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert trie.nodes > 10000
    assert used <= trie.approximate_bytes <= 1.5 * used, (used, trie.nodes * NODE_BYTES)


def test_the_native_trie_gives_the_python_tries_answers(monkeypatch):
    """Node for node (ids, children's order, counts) after inserts and removals, and the same
    matches, longest suffixes and continuations (ties, probabilities to the bit)."""
    make_trie = native_trie(monkeypatch)
    rng = random.Random(4)
    for depth in (2, 5, 9):
        python, native = SuffixTrie(depth), make_trie(depth)
        docs = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(8)]
        for trie in (python, native):
            for doc in docs:
                trie.insert(doc)
            trie.remove(docs[1])
            trie.remove(docs[3])
            trie.insert(docs[1])  # freed nodes reused in the same order
        assert native.nodes == python.nodes
        for node in range(len(python.counts)):
            assert native.children(node) == list(python.children(node))
            assert native.count(node) == python.count(node)
        for _ in range(200):
            context = [rng.randrange(5) for _ in range(rng.randrange(0, 12))]
            max_length, min_count = rng.randrange(0, 8), rng.randrange(1, 3)
            assert native.match(context, max_length, min_count) == python.match(context, max_length, min_count)
            node, _ = python.match(context, 6)
            scales = [rng.random() for _ in range(16)]
            arguments = (node, python.count(node) or 1, scales, rng.randrange(1, 15), rng.randrange(1, 4), 0.01)
            assert [tuple(c) for c in native.continuations(*arguments)] == python.continuations(*arguments)
        appenders = (python.appender(), native.appender())
        for _ in range(80):
            token = rng.randrange(5)
            for appender in appenders:
                appender.append(token)
            for max_length in (1, 3, 8):
                assert tuple(appenders[1].longest(max_length, 2)) == appenders[0].longest(max_length, 2)


def test_the_native_byte_estimate_is_what_its_containers_hold(monkeypatch):
    """Linear in the nodes (what eviction frees), within what the native containers hold."""
    make_trie = native_trie(monkeypatch)
    rng = random.Random(2)
    trie = make_trie(max_depth=16)
    trie.insert([rng.randrange(40000) for _ in range(1500)])
    assert trie.nodes > 10000
    assert trie.approximate_bytes == (trie.nodes + 1) * NATIVE_NODE_BYTES
    assert 0.6 * trie.container_bytes() <= trie.approximate_bytes <= 1.5 * trie.container_bytes()


def test_the_store_is_safe_to_share_between_threads(make_trie):
    store = SuffixStore(max_bytes=2 << 20, max_depth=8)
    rng = random.Random(3)
    docs = [[rng.randrange(50) for _ in range(40)] for _ in range(80)]

    def writer(part: list[list[int]]) -> None:
        for doc in part:
            store.add(doc)
            with store.lock:
                store.trie.match(doc[:10], 6)

    threads = [threading.Thread(target=writer, args=(docs[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert paths(store.trie) == naive_counts([list(d) for d in store.documents], 8)


def test_proposals_on_a_hand_made_corpus_are_the_expected_tree():
    proposer = SuffixProposer(SuffixConfig(cache_mb=0, max_depth=8, max_match=4, priced=False))
    proposer.confidence["local"] = Confidence(prior=CERTAIN)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2]
    proposer.begin(None, prompt, None)
    tree = proposer.propose(prompt, 4)
    # "1 2" was followed by 3 twice and by 4 once (its last occurrence has no continuation);
    # "1 2 3" by 1 and by 9 once each
    assert tree.tokens.tolist() == [3, 4, 9, 1]
    assert tree.parents.tolist() == [0, 0, 1, 1]
    probabilities = [n.probability for n in proposer._last]
    assert probabilities == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert proposer.expected_tokens(2) == pytest.approx(2.0)  # 1 + 2/3 + 1/3


def test_the_global_store_proposes_what_earlier_requests_answered():
    proposer = SuffixProposer(SuffixConfig(cache_mb=1, max_depth=8, max_match=3, priced=False))
    proposer.confidence["global"] = Confidence(prior=CERTAIN)
    question = [50, 51, 52]
    for answer in ([7, 8, 9, 10], [7, 8, 11, 12], [7, 8, 9, 10]):  # the third refreshes the first
        proposer.begin(None, question, None)
        proposer.propose(question + answer, 0)
        proposer.finish()
    assert len(proposer.store.documents) == 2
    request = proposer.__copy__()  # a serving request's copy shares the store
    request.begin(None, [60] + question, None)
    tree = request.propose([60] + question + [7], 3)
    # after "52 7": 8 (2 of 2), then 11 or 9 (1 of 2 each; a tie goes to the newer)
    assert tree.tokens.tolist() == [8, 11, 9] and tree.parents.tolist() == [0, 1, 1]
    assert [n.probability for n in request._last] == pytest.approx([1.0, 0.5, 0.5])
    assert request.stats()["suffix_store"]["hits"] == 1
    assert request.store is proposer.store


def test_confidence_learns_from_verified_nodes():
    proposer = SuffixProposer(SuffixConfig(cache_mb=0, max_depth=8, max_match=4, priced=False))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    bucket = bucket_of(4)  # the longest suffix seen before: "2 3 1 2"
    before = proposer.confidence["local"].factor(bucket)
    for _ in range(20):  # requests share what was learnt
        request = proposer.__copy__()
        request.begin(None, prompt, None)
        tree = request.propose(prompt, 1)
        assert tree.tokens.tolist() == [3] and request._last[0].bucket == bucket
        request.observe(tree, VerifyResult([], [], 5, False), None)  # rejected
    assert proposer.confidence["local"].factor(bucket) < before / 2


def test_specs_parse_and_bad_ones_say_what_is_accepted():
    assert split_suffix_graft("eagle3:x+suffix:32") == ("eagle3:x", "32")
    assert split_suffix_graft("suffix") == ("suffix", None)
    proposer = build_proposer("suffix:8,16", None)
    assert proposer.store.max_bytes == 8 << 20 and proposer.config.max_depth == 16
    with pytest.raises(EyasError, match="suffix\\[:CACHE_MB"):
        build_proposer("suffix:a,b,c", None)
    with pytest.raises(EyasError, match="MAX_DEPTH must be >= 4"):
        build_proposer("suffix:8,2", None)
    with pytest.raises(EyasError, match="cannot take it"):
        build_proposer("ngram+suffix", None)
