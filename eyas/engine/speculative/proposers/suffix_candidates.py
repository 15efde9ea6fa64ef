"""Suffix-decoding candidates: continuations of a matched suffix, ranked by how likely each one
is to lie on the accepted path.

From the node of the longest matched suffix (length m), every continuation seen after it is a
candidate; its probability of being accepted once its parent was is the count ratio
count(child) / count(parent), times the observed confidence in count ratios at that match
length (`Confidence`: a one-time continuation after a 1-token match is rarely right, after a
12-token match almost always). A node's probability of lying on the accepted path is the
product down its path. Candidates are grown best first (a heap), at most `max_children` per
node, so a frequent continuation is followed deep and a rare one is cut at once.

Two sources feed a proposal, the request's own prompt + output and the global store; their
candidates are merged by token path, and a path both propose keeps the larger probability, so
the two are scored on one scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eyas.engine.speculative.proposers.suffix_trie import SuffixTrie

BUCKET_LIMITS = (1, 2, 3, 4, 6, 9, 15)  # match lengths: bucket i holds lengths <= limit i
PRIOR_CONFIDENCE = (0.3, 0.45, 0.55, 0.65, 0.75, 0.85, 0.9, 0.95)  # one per bucket, + the last


def bucket_of(match_length: int) -> int:
    for index, limit in enumerate(BUCKET_LIMITS):
        if match_length <= limit:
            return index
    return len(BUCKET_LIMITS)


_BUCKETS = [bucket_of(length) for length in range(BUCKET_LIMITS[-1] + 1)]  # a lookup, hot path
_LAST_BUCKET = len(BUCKET_LIMITS)


@dataclass
class Confidence:
    """P(a continuation is accepted | its parent was) / its count ratio, per matched length
    bucket, learned online with a prior; the evidence decays toward the prior (`relax`)."""

    prior: tuple[float, ...] = PRIOR_CONFIDENCE
    weight: float = 4.0  # pseudo-observations behind the prior
    relax_rate: float = 0.995  # evidence kept per step
    hits: list[float] = field(default_factory=list)
    expected: list[float] = field(default_factory=list)  # summed count ratios of the trials

    def __post_init__(self) -> None:
        if len(self.prior) != len(BUCKET_LIMITS) + 1:
            raise ValueError(f"a confidence prior needs {len(BUCKET_LIMITS) + 1} values")
        self.hits = [0.0] * len(self.prior)
        self.expected = [0.0] * len(self.prior)

    def factor(self, bucket: int) -> float:
        value = ((self.hits[bucket] + self.prior[bucket] * self.weight)
                 / (self.expected[bucket] + self.weight))
        return min(value, 1.0)

    def record(self, bucket: int, ratio: float, accepted: bool) -> None:
        self.hits[bucket] += float(accepted)
        self.expected[bucket] += ratio

    def relax(self) -> None:
        self.hits = [h * self.relax_rate for h in self.hits]
        self.expected = [e * self.relax_rate for e in self.expected]


@dataclass
class Candidate:
    token: int
    parent: int  # index of the parent candidate, -1 = the root
    depth: int  # 1 = a child of the root
    probability: float  # of lying on the accepted path
    ratio: float  # count(node) / count(parent)
    bucket: int  # the match-length bucket it was predicted from
    source: str  # "local" (the request) or "global" (the store)


def grow(trie: SuffixTrie, node: int, match_length: int, first_denominator: int,
         confidence: Confidence, source: str, limit: int, max_children: int = 4,
         min_probability: float = 0.01) -> list[Candidate]:
    """At most `limit` candidates under trie `node` (the matched suffix of `match_length`
    tokens), best first; parents always come before their children. `first_denominator`:
    the occurrences of the matched suffix that can have a continuation. The heap itself is
    the trie's (`continuations`: native where the extension loads)."""
    # the confidence of a child predicted from its parent at depth d: bucket of match + d
    buckets = [_BUCKETS[length] if length < len(_BUCKETS) else _LAST_BUCKET
               for length in range(match_length, match_length + limit + 1)]
    factors = {bucket: confidence.factor(bucket) for bucket in set(buckets)}
    found = trie.continuations(node, first_denominator, [factors[b] for b in buckets], limit,
                               max_children, min_probability)
    return [Candidate(token, parent, depth, probability, ratio, buckets[depth - 1], source)
            for token, parent, depth, probability, ratio in found]


def merge(sources: list[list[Candidate]]) -> list[Candidate]:
    """One candidate list from several, merged by token path; a path in more than one keeps
    the candidate with the larger probability. Parents still come before children."""
    merged: list[Candidate] = []
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged candidate
    for candidates in sources:
        renamed: list[int] = []
        for candidate in candidates:
            parent = renamed[candidate.parent] if candidate.parent >= 0 else -1
            key = (parent, candidate.token)
            at = index.get(key)
            if at is None:
                at = index[key] = len(merged)
                merged.append(Candidate(candidate.token, parent, candidate.depth,
                                        candidate.probability, candidate.ratio, candidate.bucket,
                                        candidate.source))
            elif candidate.probability > merged[at].probability:
                merged[at] = Candidate(candidate.token, parent, candidate.depth,
                                       candidate.probability, candidate.ratio, candidate.bucket,
                                       candidate.source)
            renamed.append(at)
    return merged


def ranked(candidates: list[Candidate]) -> list[int]:
    """Candidate indices best first; a parent always ranks before its children."""
    return sorted(range(len(candidates)),
                  key=lambda i: (-candidates[i].probability, candidates[i].depth, i))
