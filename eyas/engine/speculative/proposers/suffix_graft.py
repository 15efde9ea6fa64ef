"""`X+suffix`: a proposer's draft tree (EAGLE-3) with the suffix-decoding tree merged into it.

Why: the head predicts prose it has seen the like of; suffix decoding predicts text seen
before, in this request or an earlier one (a re-sent transcript, a regenerated answer, code
rewritten), often many tokens at once and at no drafting cost. One verification pass checks
both: the suffix candidates become more branches of the head's tree, sharing nodes where both
agree.

How every node is scored on one scale: its probability of lying on the accepted path. A head
node's comes from the head's rank statistics multiplied down its path (sizing.py, as the head
prices its own trees); a suffix node's is its count-ratio estimate (suffix_candidates.py); a
node both propose keeps the larger. With measured costs (EAGLE-3 with --tree auto) the nodes
are ranked by that probability (a child never outranks its parent) and the prefix with the
most expected tokens per second, (1 + sum) / (verify(1 + n) + drafting), is verified, within
the step's budget: so the tree spends its budget on whichever source is likelier at each
depth, and a suffix branch that is usually wrong costs nothing. Without measured costs (a fixed
--tree) the suffix nodes fill the budget left after the head's tree.

The head sees only its own nodes' statistics (`renumber`: the others have rank 0); the suffix
proposer learns from the nodes it proposed. For the serving rule a budget of k nodes is
priced as the best split: the head's expected tokens for k - b nodes plus the b best suffix
candidates' probabilities.

Usage:
    eyas generate --draft eagle3:smollm2-135m+suffix
    eyas serve --draft "eagle3:smollm2-135m+suffix:256"      # the store's CACHE_MB
"""

from __future__ import annotations

import copy

import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.proposers.graft_base import GraftedTree
from eyas.engine.speculative.proposers.suffix import SuffixProposer
from eyas.engine.speculative.proposers.suffix_candidates import Candidate


class SuffixGraftProposer(GraftedTree):
    suffix_name = "+suffix"

    def __init__(self, main, suffix: SuffixProposer) -> None:
        super().__init__(main, hint=" (for suffix decoding alone: --draft suffix)")
        self.suffix = suffix
        self._nodes: list[Candidate | None] = []  # the last tree's suffix nodes, in node order

    def __copy__(self) -> SuffixGraftProposer:
        twin = object.__new__(SuffixGraftProposer)
        twin.__dict__.update(self.__dict__)
        twin.main, twin.suffix = copy.copy(self.main), copy.copy(self.suffix)
        twin.grafted, twin._nodes = 0, []
        return twin

    # -- lifecycle ----------------------------------------------------------------------
    def begin(self, target, prompt_ids, params) -> None:
        self.main.begin(target, prompt_ids, params)
        self.suffix.begin(target, prompt_ids, params)
        self.grafted, self._nodes = 0, []

    def finish(self) -> None:
        self.suffix.finish()

    def forget(self) -> None:
        self.suffix.forget()

    def sync(self, token_ids: list[int]) -> None:
        """Catch the suffix history up with the request's tokens (serving: after every step,
        so that its candidates price the next one)."""
        self.suffix.sync(token_ids)

    # -- drafting -----------------------------------------------------------------------
    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        tree = self.main.propose(token_ids, max_nodes).truncated(max(max_nodes, 0))
        self.suffix.sync(token_ids)
        self._nodes = []
        if tree.draft_probs is not None or max_nodes <= 0:
            return tree  # a sampled chain (its probabilities cover it alone), or no room
        order, _ = self.suffix.best(max_nodes)
        candidates = self.suffix.candidates(max_nodes)
        priced = self._can_price()
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        on_path = self._head_on_path(parents) if priced else [1.0] * (len(tokens) + 1)
        nodes: list[Candidate | None] = [None] * len(tokens)
        child = {(p, t): n for n, (p, t) in enumerate(zip(parents, tokens), start=1)}
        node_of: dict[int, int] = {}  # candidate index -> merged node
        for index in order:
            candidate = candidates[index]
            parent = node_of[candidate.parent] if candidate.parent >= 0 else 0
            node = child.get((parent, candidate.token))
            if node is None:
                if not priced and len(tokens) >= max_nodes:
                    break
                tokens.append(candidate.token)
                parents.append(parent)
                on_path.append(0.0)
                nodes.append(None)
                node = child[(parent, candidate.token)] = len(tokens)
            node_of[index] = node
            on_path[node] = max(on_path[node], candidate.probability)
            nodes[node - 1] = Candidate(candidate.token, parent, candidate.depth,
                                        candidate.probability, candidate.ratio, candidate.bucket,
                                        candidate.source)
        kept = list(range(1, len(tokens) + 1))
        if priced:
            kept = self._cut(on_path, tree.size, max_nodes)
        new_id = {old: new for new, old in enumerate(kept, start=1)}
        self.main.renumber([new_id.get(n, 0) for n in range(1, tree.size + 1)], len(kept))
        self._nodes = []
        for old in kept:
            node = nodes[old - 1]
            if node is not None:
                node = Candidate(node.token, new_id.get(node.parent, 0), node.depth,
                                 node.probability, node.ratio, node.bucket, node.source)
            self._nodes.append(node)
        self.grafted += sum(1 for old in kept if old > tree.size)
        if not kept:
            return DraftTree.empty()
        return DraftTree(torch.tensor([tokens[n - 1] for n in kept], dtype=torch.long),
                         torch.tensor([new_id.get(parents[n - 1], 0) for n in kept], dtype=torch.long))

    def _head_on_path(self, parents: list[int]) -> list[float]:
        """P(on the accepted path) of the root (1) and each head node, from its rank statistics."""
        on_path = [1.0]
        for node, parent in enumerate(parents, start=1):
            on_path.append(on_path[parent] * self._head_step(node))
        return on_path

    # -- pricing for the serving rule ---------------------------------------------------------
    def expected_tokens(self, max_nodes: int) -> float | None:
        main = getattr(self.main, "expected_tokens", None)
        best = main(max_nodes) if main is not None else None
        if best is None or not self.suffix.synced:
            return best
        order, _ = self.suffix.best(max_nodes)
        for b in range(1, len(order) + 1):
            rest = main(max_nodes - b) if max_nodes > b else 1.0
            best = max(best, rest + self.suffix.best(b)[1])
        return best

    # -- feedback -------------------------------------------------------------------------
    def renumber(self, node_map: list[int], size: int) -> None:
        """The tree was cut further (drafts a grammar forbids, `prune.prune_draft`): the main
        proposer's statistics follow its nodes; this step's suffix nodes are not scored."""
        self._nodes = []
        self.main.renumber(node_map, size)

    def observe(self, tree, result, output) -> None:
        if result is not None:
            if tree is not None and tree.size and len(self._nodes) == tree.size:
                self.suffix.learn(self._nodes, result.accepted_nodes)
            self.suffix.follow(result.emitted)
        self._nodes = []
        self.main.observe(tree, result, output)

    def stats(self) -> dict:
        stats = self.main.stats() if hasattr(self.main, "stats") else {}
        return {**stats, **self.suffix.stats(), "suffix_grafted_nodes": self.grafted}
