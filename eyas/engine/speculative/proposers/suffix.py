"""`suffix`: suffix decoding. Drafts from the request's own prompt + output and from a global
store of earlier requests' outputs; the draft is a tree whose size follows how often each
continuation was seen.

Per request, a suffix trie bounded by depth (suffix_trie.py) indexes the prompt and then every
emitted token; the global store (suffix_store.py, shared by every request of a server, least
recently used out, bounded by CACHE_MB) indexes the outputs of finished requests. Each step:

1. Match: the longest suffix of the context (at most `max_match` tokens) seen before, in the
   request (an earlier occurrence, not the current one) and in the store.
2. Candidates: the continuations after each match, best first, each with its probability of
   lying on the accepted path: count ratios times the confidence observed for count ratios at
   that match length, multiplied down the path (suffix_candidates.py); the two sources are
   merged on one scale.
3. Size: with measured verification costs (single-stream decoding, `single_stream`), the best
   n candidates with the most expected tokens per second, (1 + sum of probabilities) /
   verify(1 + n), n = 0 being a plain step: on text that does not repeat itself suffix
   decoding steps aside. The serving engine prices the same candidates through
   `expected_tokens` and fills the budget it chooses.
4. Learn: each verified node whose parent was accepted is a trial of its bucket's confidence.

A request's output enters the store when it finishes (`finish`): the last `max_match` prompt
tokens (the end of the question and the chat template's assistant header) then the output.

Usage:
    eyas generate --draft suffix                      # 64 MB store, tries 24 tokens deep
    eyas serve --draft suffix:256                     # CACHE_MB
    eyas serve --draft suffix:256,32                  # CACHE_MB, MAX_DEPTH
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.proposers.suffix_candidates import Candidate, Confidence, grow, merge, ranked
from eyas.engine.speculative.proposers.suffix_store import SuffixStore
from eyas.engine.speculative.proposers.suffix_trie import new_trie
from eyas.engine.speculative.sizing import best_prefix, load_or_measure
from eyas.errors import EyasError

MIN_GROWN = 8  # candidates grown per source at least (pricing asks for budgets 1, 2, ...)


@dataclass
class SuffixConfig:
    cache_mb: float = 64.0  # the global store's memory bound; 0 = the request's own text only
    max_depth: int = 24  # tokens per trie path: match + continuation
    max_match: int = 12  # longest context suffix matched
    max_candidates: int = 32  # candidates grown per step, before sizing
    max_children: int = 4  # continuations followed per node
    priced: bool = True  # cut the tree where expected tokens per second peak (single_stream)

    def __post_init__(self) -> None:
        if self.cache_mb < 0:
            raise EyasError(f"suffix CACHE_MB must be >= 0, got {self.cache_mb}")
        if self.max_depth < 4:
            raise EyasError(f"suffix MAX_DEPTH must be >= 4, got {self.max_depth}")
        if not 1 <= self.max_match < self.max_depth:
            raise EyasError(f"suffix max_match must be in 1..MAX_DEPTH - 1, got {self.max_match}")
        if self.max_candidates < 1 or self.max_children < 1:
            raise EyasError("suffix max_candidates and max_children must be >= 1")

    @classmethod
    def parse(cls, option: str) -> SuffixConfig:
        """'' | 'CACHE_MB' | 'CACHE_MB,MAX_DEPTH' (the text after 'suffix:')."""
        parts = option.split(",") if option else []
        try:
            if len(parts) > 2:
                raise ValueError(option)
            cache_mb = float(parts[0]) if parts else cls.cache_mb
            depth = int(parts[1]) if len(parts) > 1 else cls.max_depth
        except ValueError:
            raise EyasError(f"bad 'suffix:{option}'; accepted: suffix[:CACHE_MB[,MAX_DEPTH]]") from None
        return cls(cache_mb=cache_mb, max_depth=depth, max_match=min(cls.max_match, depth // 2))


class SuffixProposer:
    name = "suffix"
    tap_layers: tuple[int, ...] = ()

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.store = SuffixStore(int(self.config.cache_mb * (1 << 20)), self.config.max_depth)
        self.confidence = {"local": Confidence(), "global": Confidence()}  # shared by copies
        self.cost = None  # sizing.CostModel: single_stream
        self._reset([])

    def _reset(self, prompt_ids: list[int]) -> None:
        self.local = new_trie(self.config.max_depth)
        self.appender = self.local.appender()
        self.history: list[int] = []
        self.prompt_length = len(prompt_ids)
        self._extend(prompt_ids)
        self.finished = False
        self.synced = False  # history ends with the root (after a propose): observe may extend it
        self._candidates: list[Candidate] | None = None  # for the current history
        self._grown = 0  # how many candidates per source that list was grown to
        self._order: list[int] = []  # the candidates' indices, best first
        self._sums: list[float] = [0.0]  # their running sums of probabilities
        self._last: list[Candidate] = []  # the verified tree's nodes, in node order
        self.counts = {"local_matches": 0, "global_matches": 0, "steps": 0,
                       "local_nodes": 0, "global_nodes": 0}

    def __copy__(self) -> SuffixProposer:
        """A request's proposer (serving): shares the store, the confidence and the costs."""
        twin = object.__new__(SuffixProposer)
        twin.__dict__.update(self.__dict__)
        twin._reset([])
        return twin

    # -- lifecycle ----------------------------------------------------------------------
    def use_costs(self, cost) -> None:
        self.cost = cost

    def single_stream(self, target, fallback: bool = True) -> None:
        """Decoding one request: size trees from the target's measured verification costs
        (sizing the tree is the method itself: `fallback` changes nothing here)."""
        if self.config.priced and self.cost is None:
            self.use_costs(load_or_measure(target))

    def begin(self, target, prompt_ids, params) -> None:
        self.finish()  # a proposer reused for the next prompt stores the last one first
        self._reset(list(prompt_ids))

    def finish(self) -> None:
        """The request ended: its output enters the global store (once)."""
        if self.finished or self.store.max_bytes == 0:
            self.finished = True
            return
        self.finished = True
        output = self.history[self.prompt_length :]
        if output:
            start = max(self.prompt_length - self.config.max_match, 0)
            self.store.add(self.history[start:])

    def forget(self) -> None:
        """Empty the global store (a benchmark's warm-up outputs must not help its prompts)."""
        self.finished = True
        self.store.clear()

    def _extend(self, tokens: list[int]) -> None:
        self.appender.extend(tokens)
        self.history.extend(tokens)
        if tokens:
            self._candidates = None

    # -- drafting -----------------------------------------------------------------------
    def sync(self, token_ids: list[int]) -> None:
        """Catch the history up with the request's tokens (prompt + output, the root last)."""
        self._extend(token_ids[len(self.history) :])
        self.synced = True

    def follow(self, emitted: list[int]) -> None:
        """Tokens a step emitted; ignored until the history holds the root (the first token
        after the prefill reaches the proposer only through `sync`)."""
        if self.synced:
            self._extend(emitted)

    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        self.sync(token_ids)
        if max_nodes <= 0:
            self._last = []
            return DraftTree.empty()
        candidates = self.candidates(max_nodes)
        order = self._order[:max_nodes]
        if self.cost is not None and self.config.priced:
            order = order[: best_prefix([candidates[i].probability for i in order], self.cost)]
        return self._tree(candidates, order)

    def candidates(self, at_least: int | None = None) -> list[Candidate]:
        """The best candidates after the current history (at least `at_least` where there are
        that many, at most `max_candidates`), merged over both sources; cached until the
        history grows. The serving engine prices every row each step, with budgets of a few
        nodes: growing only as many as asked keeps that cheap."""
        wanted = min(max(at_least or self.config.max_candidates, MIN_GROWN), self.config.max_candidates)
        if self._candidates is None or wanted > self._grown:
            self._grown = wanted
            self._candidates = self._grow(wanted)
            self._order = ranked(self._candidates)
            self._sums = [0.0]
            for index in self._order:
                self._sums.append(self._sums[-1] + self._candidates[index].probability)
        return self._candidates

    def best(self, max_nodes: int) -> tuple[list[int], float]:
        """The indices of the best `max_nodes` candidates and the sum of their probabilities."""
        self.candidates(max_nodes)
        count = min(max_nodes, len(self._order))
        return self._order[:count], self._sums[count]

    def _grow(self, limit: int) -> list[Candidate]:
        config, context = self.config, self.history
        self.counts["steps"] += 1
        sources = []
        node, length = self.appender.longest(config.max_match, min_count=2)  # local.match's
        if length:  # the current occurrence has no continuation yet: one count less
            self.counts["local_matches"] += 1
            sources.append(grow(self.local, node, length, self.local.count(node) - 1,
                                self.confidence["local"], "local", limit, config.max_children))
        if self.store.max_bytes and self.store.documents:
            with self.store.lock:
                node, length = self.store.trie.match(context, config.max_match)
                found = grow(self.store.trie, node, length, self.store.trie.count(node),
                             self.confidence["global"], "global", limit,
                             config.max_children) if length else []
            self.store.record_lookup(bool(found))
            if found:
                self.counts["global_matches"] += 1
                sources.append(found)
        return merge(sources) if len(sources) > 1 else (sources[0] if sources else [])

    def _tree(self, candidates: list[Candidate], order: list[int]) -> DraftTree:
        """The candidates in `order` (parents first) as a DraftTree; remembered for `observe`."""
        node_of = {index: node for node, index in enumerate(order, start=1)}
        kept = [candidates[i] for i in order]
        self._last = [Candidate(c.token, node_of.get(c.parent, 0) if c.parent >= 0 else 0,
                                c.depth, c.probability, c.ratio, c.bucket, c.source) for c in kept]
        for c in kept:
            self.counts[f"{c.source}_nodes"] += 1
        if not kept:
            return DraftTree.empty()
        return DraftTree(torch.tensor([c.token for c in kept], dtype=torch.long),
                         torch.tensor([c.parent for c in self._last], dtype=torch.long))

    # -- pricing for the serving rule (eyas.scheduler.speculation.TreePricing) -------------
    def expected_tokens(self, max_nodes: int) -> float | None:
        """Tokens per step, bonus included, of the best `max_nodes` candidates after the
        history so far; None before the first step (no context yet)."""
        if not self.synced or max_nodes < 1:
            return None
        return 1.0 + self.best(max_nodes)[1]

    def draft_seconds(self, max_nodes: int) -> float:
        return 0.0  # trie lookups: microseconds, measured by the engine anyway

    def drafted_nodes(self) -> list[Candidate]:
        """The last proposed tree's nodes, in node order (for `learn`: a shadow draft, one
        that is compared with the tokens the target emits instead of verified)."""
        return list(self._last)

    # -- feedback -------------------------------------------------------------------------
    def observe(self, tree, result, output) -> None:
        if result is None:
            return
        if tree is not None and tree.size and len(self._last) == tree.size:
            self.learn(self._last, result.accepted_nodes)
        self._last = []
        self.follow(result.emitted)

    def learn(self, nodes: list[Candidate | None], accepted_nodes: list[int]) -> None:
        """Confidence trials: each node (parent = a 1-based node id, 0 = root) whose parent was
        accepted, hit when it was accepted too; None: a node another proposer drafted."""
        accepted = set(accepted_nodes)
        for node, candidate in enumerate(nodes, start=1):
            if candidate is not None and (candidate.parent == 0 or candidate.parent in accepted):
                self.confidence[candidate.source].record(candidate.bucket, candidate.ratio,
                                                         node in accepted)
        for confidence in self.confidence.values():
            confidence.relax()

    def stats(self) -> dict:
        return {"suffix": dict(self.counts), "suffix_store": self.store.stats()}


def build_suffix(option: str) -> SuffixProposer:
    return SuffixProposer(SuffixConfig.parse(option))
