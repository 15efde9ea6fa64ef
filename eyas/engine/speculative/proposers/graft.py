"""`X+ngram`: a proposer's draft tree with the prompt-lookup continuation grafted onto it.

Why: a trained head and prompt lookup are right in different places. The head predicts prose
it has seen the like of; prompt lookup predicts text that repeats the prompt or the answer so
far (names, code, lists), often several tokens at once and at no drafting cost. One
verification pass can check both: the n-gram continuation becomes one more branch of the
tree, sharing the nodes where both agree, so a step accepts whichever branch was right.

How: the main proposer drafts its tree first, with the step's budget; the n-gram branch (at
most `graft_tokens` tokens, only where an n-gram of at least `min_n` tokens matched) is then
merged in as a trie. The n-gram nodes come after the main tree's nodes; with measured costs
they compete with them for the budget (below), without, the budget cuts them first. Only the
main proposer sees its statistics: it is told how its nodes were renumbered (`renumber`), and
a node it did not draft has rank 0 for it.

Which nodes to verify is priced like the tree itself (sizing.py), jointly for the main tree
and the branch, within the step's budget of nodes: each node's probability of lying on the
accepted path comes from the main proposer's rank statistics (main nodes) or from the observed
acceptance of the branch's j-th new node once the one before it was accepted (`BranchStats`,
one per matched n-gram length, decaying toward its prior so that a cut branch is tried again;
branch nodes), multiplied down the path. Nodes are ranked by that probability (a child never
outranks its parent, so every prefix of the ranking is a tree), and the prefix with the most
expected tokens per second of the step, (1 + sum of probabilities) / (verify(1 + nodes) +
drafting), is kept (at most the budget), with the measured verification costs. So a reliable
branch displaces the head's weaker guesses, even at a budget of one node, and an unreliable one
costs nothing when verification past a few tokens is expensive. Without measured costs (a
fixed `--tree`) every node that fits the budget is kept.

For the serving rule (eyas.scheduler.speculation), the graft prices a budget of k nodes as
the best split between the two: the main proposer's expected tokens for k - b nodes plus what
the first b nodes of a branch add, `match_rate` x (r1 + r1 r2 + ... + r1..rb), where
`match_rate` is how often an n-gram matched over the request's recent steps and r_j are the
statistics of the last matched length. So a request whose text repeats itself is given the
budget its branch needs.

Usage:
    eyas generate --draft eagle3:smollm2-135m+ngram            # n-gram 3..2, 4 tokens
    eyas generate --draft "eagle3:smollm2-135m+ngram:3,1,4"    # MAX_N, MIN_N, GRAFT_TOKENS
"""

from __future__ import annotations

import copy

import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.proposers.graft_base import GraftedTree
from eyas.engine.speculative.proposers.ngram import BranchStats, find_continuations
from eyas.errors import EyasError

MATCH_RATE_KEPT = 0.8  # weight a request's match rate keeps at each step


class NgramGraftProposer(GraftedTree):
    suffix_name = "+ngram"

    def __init__(self, main, max_n: int = 3, min_n: int = 2, graft_tokens: int = 4,
                 search_window: int = 4096) -> None:
        if hasattr(main, "renumber") and (not 1 <= min_n <= max_n or graft_tokens < 1):
            raise EyasError("+ngram:MAX_N,MIN_N,GRAFT_TOKENS needs 1 <= MIN_N <= MAX_N and "
                            f"GRAFT_TOKENS >= 1, got {max_n},{min_n},{graft_tokens}")
        super().__init__(main)
        self.max_n, self.min_n, self.graft_tokens = max_n, min_n, graft_tokens
        self.search_window = search_window
        # one BranchStats per matched n-gram length: a 3-token match is right more often
        self.branches = {n: BranchStats(graft_tokens) for n in range(min_n, max_n + 1)}
        # the last step's grafted branch: its statistics, first new id, tree size, graft parent
        self._last: tuple[BranchStats, int, int, int] | None = None
        # How often an n-gram matched lately, and the length matched last (the serving rule's
        # price): per request, starting from the average over every request so far (the
        # average is shared by the copies).
        self.match_rate, self.last_n = 0.0, max_n
        self._pooled_match = [0.0]

    def __copy__(self) -> NgramGraftProposer:
        twin = object.__new__(NgramGraftProposer)
        twin.__dict__.update(self.__dict__)
        twin.main = copy.copy(self.main)  # per-request state lives in the main proposer
        twin.grafted, twin._last = 0, None  # the branch statistics are shared, as the head's are
        twin.match_rate = self._pooled_match[0]  # per request: how repetitive its text is
        return twin

    def expected_tokens(self, max_nodes: int) -> float | None:
        """Tokens per step for a budget of `max_nodes`, at the best split between the main
        tree (k - b nodes) and the branch's first b nodes (module docstring); None when the
        main proposer cannot price its tree."""
        main = getattr(self.main, "expected_tokens", None)
        best = main(max_nodes) if main is not None else None
        if best is None:
            return None
        stats = self.branches[self.last_n]
        branch, on_path = 0.0, 1.0
        for b in range(1, min(max_nodes, self.graft_tokens) + 1):
            on_path *= stats.rate(b - 1)
            branch += self.match_rate * on_path
            rest = main(max_nodes - b) if max_nodes > b else 1.0
            best = max(best, rest + branch)
        return best

    def begin(self, target, prompt_ids, params) -> None:
        self.main.begin(target, prompt_ids, params)
        self.grafted, self.match_rate = 0, self._pooled_match[0]

    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        tree = self.main.propose(token_ids, max_nodes).truncated(max(max_nodes, 0))
        if tree.draft_probs is not None or max_nodes <= 0:
            self._last = None  # a sampled chain (its probabilities cover it alone), or no room
            return tree
        for stats in self.branches.values():
            stats.relax()
        n, branch = self._continuation(token_ids)
        self._record_match(n, bool(branch))
        priced = self._can_price()  # then the branch competes for the budget (see _priced)
        merged, node_map = graft_branch(tree, branch, tree.size + len(branch) if priced else max_nodes)
        first_new = tree.size + 1  # merged ids from here on are the branch's new nodes
        if merged.size > tree.size and priced:
            merged, node_map, first_new = self._priced(tree, merged, node_map, self.branches[n],
                                                       max_nodes)
        self._last = None
        if merged.size >= first_new:
            self._last = (self.branches[n], first_new, merged.size, int(merged.parents[first_new - 1]))
        self.grafted += merged.size - first_new + 1
        self.main.renumber(node_map, merged.size)
        return merged

    def _record_match(self, n: int, matched: bool) -> None:
        """Follow how often an n-gram matches (the serving rule's price of the branch)."""
        hit = 1.0 if matched else 0.0
        self.match_rate = MATCH_RATE_KEPT * self.match_rate + (1 - MATCH_RATE_KEPT) * hit
        self._pooled_match[0] = 0.98 * self._pooled_match[0] + 0.02 * hit
        if matched:
            self.last_n = n

    def _priced(self, tree: DraftTree, merged: DraftTree, node_map: list[int],
                stats: BranchStats, max_nodes: int) -> tuple[DraftTree, list[int], int]:
        """The nodes of `merged` worth verifying, priced as in the module docstring: each node's
        probability of lying on the accepted path (main nodes from the main proposer's rank
        statistics, new nodes from the branch's `stats`), best first (a child never outranks its
        parent, so every prefix is a tree), cut where expected tokens per second peak, at
        `max_nodes` at most. Returns the tree, the main nodes' new ids (0 = dropped) and the
        first new node's id."""
        parents = merged.parents.tolist()
        on_path = [1.0]  # node 0 = the root
        for node, parent in enumerate(parents, start=1):
            step = self._head_step(node) if node <= tree.size else stats.rate(node - tree.size - 1)
            on_path.append(on_path[parent] * step)
        kept = self._cut(on_path, tree.size, max_nodes)
        if not kept:
            return DraftTree.empty(), [0] * len(node_map), 1
        new_id = {old: new for new, old in enumerate(kept, start=1)}
        pruned = DraftTree(merged.tokens[[n - 1 for n in kept]],
                           torch.tensor([new_id.get(parents[n - 1], 0) for n in kept], dtype=torch.long))
        first_new = next((new_id[n] for n in kept if n > tree.size), pruned.size + 1)
        return pruned, [new_id.get(node, 0) for node in node_map], first_new

    def _continuation(self, token_ids: list[int]) -> tuple[int, list[int]]:
        """(n, continuation) of the longest matching n-gram; (max_n, []) when none matched."""
        window = token_ids[-self.search_window :]
        for n in range(self.max_n, self.min_n - 1, -1):
            found = find_continuations(window, n, self.graft_tokens, max_matches=1)
            if found:
                return n, found[0]
        return self.max_n, []

    def renumber(self, node_map: list[int], size: int) -> None:
        """The tree was cut further (drafts a grammar forbids, `prune.prune_draft`): the main
        proposer's statistics follow its nodes; this step's branch is not scored."""
        self._last = None
        self.main.renumber(node_map, size)

    def observe(self, tree, result, output) -> None:
        if self._last is not None and result is not None and tree is not None:
            stats, first_new, size, parent = self._last
            if size == tree.size and (parent == 0 or parent in result.accepted_nodes):
                accepted = sum(1 for node in result.accepted_nodes if node >= first_new)
                stats.record(size - first_new + 1, accepted)
        self._last = None
        self.main.observe(tree, result, output)

    def stats(self) -> dict:
        stats = self.main.stats() if hasattr(self.main, "stats") else {}
        return {**stats, "ngram_grafted_nodes": self.grafted}


def graft_branch(tree: DraftTree, branch: list[int], max_nodes: int
                 ) -> tuple[DraftTree, list[int]]:
    """`tree` with the chain `branch` (under the root) merged in, at most `max_nodes` nodes.

    Returns the merged tree and, for each node of `tree`, its node id in the merged tree (the
    same id: the tree's nodes keep their order and come first).
    """
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    node_map = list(range(1, len(tokens) + 1))
    child = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens), 1)}
    node = 0
    for token in branch:
        if (node, token) in child:
            node = child[(node, token)]
            continue
        if len(tokens) >= max_nodes:
            break
        tokens.append(token)
        parents.append(node)
        node = child[(node, token)] = len(tokens)
    if len(tokens) == tree.size:
        return tree, node_map
    return (DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)),
            node_map)
