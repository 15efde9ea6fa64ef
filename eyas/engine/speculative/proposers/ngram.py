"""`ngram`: prompt lookup. Find the last n tokens earlier in prompt + output; propose what
followed. n runs from `max_n` down to `min_n`; with `max_matches` > 1, several distinct
continuations of the longest matching n-gram become branches of a tree (shared prefixes merged).

Priced (`priced=True`, what `--draft ngram` builds; single-stream decoding hands it the
measured verification costs, `single_stream`): only the most recent continuation is drafted, cut
to the length L that maximises expected tokens per second, (1 + r1 + r1 r2 + ... + r1..rL) /
verify(1 + L), where r_j is the observed rate at which the j-th drafted token was accepted
once the one before it was, per matched n-gram length (`BranchStats`). L = 0 is a plain step:
where verifying a few more tokens costs more than their chance of being right, as on prose
over an int4 target on a CPU, prompt lookup steps aside, and comes back when the statistics
(which decay toward their prior) say the text repeats itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.sizing import best_prefix, load_or_measure
from eyas.errors import EyasError


@dataclass
class NgramConfig:
    max_n: int = 3
    min_n: int = 1
    max_matches: int = 1
    search_window: int = 4096  # only the last tokens are searched (keeps the cost bounded)
    priced: bool = False  # cut the draft where expected tokens per second peak (single_stream)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise EyasError(f"ngram sizes need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if self.max_matches < 1:
            raise EyasError("max_matches must be >= 1")


@dataclass
class BranchStats:
    """P(the j-th new node of the n-gram branch is accepted | the one before it was), j = 1..,
    counted over the steps whose accepted path reached the branch. The evidence decays toward
    the prior at every step (`relax`): a branch cut because it was rarely right is tried again
    later, when the text may have turned repetitive."""

    length: int
    prior: tuple[float, ...] = (0.4, 0.6)  # node 1, node 2, ...; the last entry for all later nodes
    weight: float = 4.0  # pseudo-observations behind the prior
    relax_rate: float = 0.99  # evidence kept per step
    hits: list[float] = field(default_factory=list)  # decayed evidence, per node j
    trials: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hits = [0.0] * self.length
        self.trials = [0.0] * self.length

    def rate(self, j: int) -> float:
        """P(new node j + 1 accepted | node j was); 0-based j."""
        if j >= self.length:
            return 0.0
        prior = self.prior[min(j, len(self.prior) - 1)]
        return (self.hits[j] + prior * self.weight) / (self.trials[j] + self.weight)

    def record(self, drafted: int, accepted: int) -> None:
        """A step that reached the branch: `accepted` of its `drafted` new nodes, in order."""
        for j in range(min(accepted, self.length)):
            self.hits[j] += 1
            self.trials[j] += 1
        if accepted < min(drafted, self.length):
            self.trials[accepted] += 1

    def relax(self) -> None:
        self.hits = [h * self.relax_rate for h in self.hits]
        self.trials = [t * self.relax_rate for t in self.trials]


def find_continuations(tokens: list[int], n: int, length: int, max_matches: int) -> list[list[int]]:
    """Distinct continuations (most recent first) of earlier occurrences of the last n tokens."""
    if len(tokens) <= n:
        return []
    suffix = tokens[-n:]
    last = suffix[-1]
    found: list[list[int]] = []
    # Scan right to left: recent context is the likeliest to repeat. The last token is compared
    # first: most positions fail there, without a slice.
    for start in range(len(tokens) - n - 1, -1, -1):
        if tokens[start + n - 1] == last and tokens[start : start + n] == suffix:
            continuation = tokens[start + n : start + n + length]
            if continuation and continuation not in found:
                found.append(continuation)
                if len(found) >= max_matches:
                    break
    return found


def merge_into_tree(branches: list[list[int]], max_nodes: int) -> DraftTree:
    """A trie of the branches, nodes in insertion order (parents first), at most max_nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for branch in branches:
        node = 0
        for token in branch:
            key = (node, token)
            if key not in children:
                if len(tokens) >= max_nodes:
                    break
                tokens.append(token)
                parents.append(node)
                children[key] = len(tokens)
            node = children[key]
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


class NgramProposer:
    name = "ngram"
    tap_layers: tuple[int, ...] = ()
    longest_priced = 16  # a priced draft is at most this long

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self.cost = None  # sizing.CostModel, from use_costs
        # one BranchStats per matched n-gram length: a 3-token match is right more often
        self.branches = {n: BranchStats(self.longest_priced)
                         for n in range(self.config.min_n, self.config.max_n + 1)}
        self._last: tuple[BranchStats, int] | None = None  # the last priced draft: stats, length

    def use_costs(self, cost) -> None:
        """Measured verification costs (eyas.engine.speculative.sizing.CostModel)."""
        self.cost = cost

    def single_stream(self, target, fallback: bool = True) -> None:
        """Decoding one request (speculative_generate): a priced proposer not yet given costs
        gets the target's measured ones (the serving engine never calls this; cutting a match
        is the method itself: `fallback` changes nothing here)."""
        if self.config.priced and self.cost is None:
            self.use_costs(load_or_measure(target))

    def begin(self, target, prompt_ids, params) -> None:
        pass

    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        if max_nodes <= 0:
            return DraftTree.empty()
        window = token_ids[-self.config.search_window :]
        priced = self.cost is not None and self.config.priced
        for n in range(self.config.max_n, self.config.min_n - 1, -1):
            matches = 1 if priced else self.config.max_matches
            branches = find_continuations(window, n, max_nodes, matches)
            if branches and priced:
                return self._priced(self.branches[n], branches[0][: self.longest_priced])
            if branches:
                return merge_into_tree(branches, max_nodes)
        return DraftTree.empty()

    def _priced(self, stats: BranchStats, chain: list[int]) -> DraftTree:
        """The prefix of `chain` with the most expected tokens per second (maybe none)."""
        on_path, reach = [], 1.0
        for j in range(len(chain)):
            reach *= stats.rate(j)
            on_path.append(reach)
        best_length = best_prefix(on_path, self.cost)
        self._last = (stats, best_length) if best_length else None
        if not best_length:
            return DraftTree.empty()
        return DraftTree(torch.tensor(chain[:best_length], dtype=torch.long),
                         torch.arange(best_length, dtype=torch.long))

    def observe(self, tree, result, output) -> None:
        if self._last is not None and result is not None and tree is not None:
            stats, length = self._last
            if tree.size == length:
                stats.record(length, len(result.accepted_nodes))
        self._last = None
        if result is not None:
            for stats in self.branches.values():
                stats.relax()
