"""`eagle3`: an EAGLE-3 head drafts a dynamic tree (EAGLE-2 expansion) from the target's taps.

Rows of the head: the row at position p reads (feature of p, token p + 1) and predicts token
p + 2. Committed rows (positions 0..n-1 after a prompt of n tokens and root x_n) use the
target's fused taps; tree rows use the head's own output of their parent row.

Per step:
1. Catch up: the head runs over the rows that the last verification made final (root and the
   accepted tokens, with the target's taps from that same pass), extending its committed KV.
2. Expand: depth 1 = top-k of the last committed row; each further level expands the current
   top-k nodes (by cumulative log-probability) together in one head pass, each yielding top-k
   children; every child stays a candidate.
3. Rerank: the best `total_tokens - 1` candidates by cumulative score (a child never outscores
   its parent, so they form a connected subtree), ordered parents first.
Tree rows are scratch: only committed rows stay in the head's KV.

Sampled requests whose tokens are Gumbel draws (engine/gumbel.py) hand the proposer their noise
(`draw_with`, coupled_draws.py): each depth's candidates are then ranked, and scored, by the
log-softmax of the head's logits x s / T plus the noise of the output position they fill, so
that the first candidate is the target's draw wherever the head's logits order the tokens as
the target's do under that noise; s is learned from the target's draws (Sharpness, starting
at COUPLED_SHARPNESS).

With no fixed shape (`--tree auto`), the shape comes from sizing.py: the target's measured
verification costs, the head's measured step costs, and the acceptance ranks observed so far;
it is chosen again every `resize_every` steps. When no shape pays (the sizing's depth 0), the
serving engine's copies still draft a one-token chain (its serving rule decides each step's
budget); in single-stream decoding (`single_stream`) only every `PROBE_EVERY`-th step drafts
one, to keep the statistics alive, and the others are plain steps (their rows are caught up
in one head pass at the next probe). Those rows also feed the statistics: the head's output
for a row of a step it did not draft in is the depth-1 draft that step would have verified,
and the token that followed is known, so the catch-up records its rank (`_shadow_ranks`),
without a verification pass. Single-stream decoding also reports each step's wall time
(`step_seconds`); the shape is then chosen from the cost model scaled to what plain and
speculative steps really took in this loop. So that both prices stay current, a shape that
drafts still takes a plain step every `PROBE_EVERY`-th step (as the serving scheduler does), and
each request's first decode step, slowed by the prefill before it, is left out of the prices.

Rows without taps: a target pass that computed no taps (single-stream steps that the fallback
keeps plain, when the next step is plain too: the taps cost every plain step their copies out
of the target's stack and the head's next catch-up their rows) leaves its rows out of the
head's KV. The head's rows keep their true positions (RoPE), so its KV then holds the rows it
saw, in order, with a gap where it saw none; drafts stay verified, so output is unchanged, and
the head's context lacks those rows only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from eyas.engine.speculative.coupled_draws import Sharpness
from eyas.engine.speculative.draft import DraftTree
from eyas.errors import EyasError
from eyas.models import extension


# Coupled draws (coupled_draws.py) rank the head's logits times a factor over T, plus the noise;
# the factor is learned from the target's draws (Sharpness), starting from this one: the shipped
# SmolLM2 head is flatter than its target, and its first draft was the target's draw 26.1 / 30.0
# / 28.6 / 27.1% of the time at 1 / 1.5 / 2 / 3 (its own top token, uncoupled: 23.8%), and 31.1
# / 31.7 / 31.3% at 1 / 1.5 / 2 at temperature 0.7 (uncoupled 30.7%): `eyas eval --tree chain:1
# --temperature 1 --seed 0`, 20 MT-Bench prompts (BENCHMARKS.md section 3).
COUPLED_SHARPNESS = 1.5


@dataclass
class TreeShape:
    depth: int = 4  # expansion levels
    top_k: int = 2  # children per expanded node, and nodes expanded per level
    total_tokens: int = 8  # root + drafts sent to verification

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise EyasError("tree shape needs depth >= 1, top_k >= 1, total_tokens >= 2")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """'chain:K' or 'DEPTH,TOPK,TOTAL'."""
        try:
            if text.startswith("chain:"):
                k = int(text.split(":", 1)[1])
                return cls(depth=k, top_k=1, total_tokens=k + 1)
            depth, top_k, total = (int(x) for x in text.split(","))
            return cls(depth, top_k, total)
        except ValueError as error:
            raise EyasError(f"bad tree shape '{text}'; accepted: chain:K or DEPTH,TOPK,TOTAL") from error


@dataclass
class _Node:
    token: int  # target id
    parent: int  # index into the candidate list, -1 = the root
    score: float  # cumulative log-probability
    depth: int
    rank: int  # 1-based rank among its parent's top-k children


class Eagle3Proposer:
    name = "eagle3"
    PROBE_EVERY = 16  # single_stream: one step in this many drafts where no shape pays, or
    # is plain where one does
    taps_optional = True  # a pass without taps leaves its rows out of the head's KV (a gap)

    def __init__(self, head, shape: TreeShape | None = None, resize_every: int = 16) -> None:
        from eyas.engine.speculative.sizing import RankStats

        self.head = head
        self.auto = shape is None
        self.shape = shape or TreeShape()
        self.resize_every = resize_every
        self.cost = None  # CostModel, measured on first use in auto mode
        self.ranks = RankStats()
        self.steps_since_resize = 0
        self.node_ranks: list[int] = []  # rank of each node of the last tree
        self.choice = None  # last TreeChoice (auto mode)
        self.shape_memo: dict[tuple[float, ...], object] = {}  # rounded rank probabilities -> TreeChoice
        self.price_memo: dict[tuple, list[float]] = {}  # (shape, rounded ranks) -> accepted_by_size
        self._priced_state: tuple | None = None  # what the last price was computed from
        self._priced_accepted: list[float] = []
        self.tap_layers = tuple(head.config.target_layer_ids)
        from eyas.eagle3.fused import FusedHead

        self.fused = FusedHead.build(head)  # the head's layer as one C++ call (eagle3/fused.py)
        self.kv = None  # its HeadCache, one per request (begin)
        self.d2t: list[int] = head.d2t.tolist()  # draft id -> target id offset (head.d2t)
        draft_ids = torch.arange(len(self.d2t), device=head.d2t.device)
        self.target_ids = head.draft_to_target(draft_ids).cpu()  # [N] int64: each draft id's target id
        self.coupling = None  # CoupledDraws of a request whose tokens are Gumbel draws (draw_with)
        self.sharpness = Sharpness(COUPLED_SHARPNESS)  # learned from the draws; copies share it
        self._coupled_probe: tuple[Tensor, int] | None = None  # (depth-1 logits [N], context) of this step
        self.past: tuple[Tensor, Tensor] | None = None  # committed KV [1, KV, n, D] (Python path)
        self._scratch_past: tuple[Tensor, Tensor] | None = None  # + the tree rows of this step
        self.committed = 0  # committed rows (slots of the head's KV)
        self.last_position = -1  # position of the last committed row (committed - 1 without gaps)
        self.next_position = 0  # position of the next row the target's passes will produce
        self.pending_taps: list[Tensor] = []  # [1, m_i, 3H] each: taps of rows to commit, in order
        self.pending_positions: list[int] = []  # position of each pending block's first row
        self.pending_unverified: list[bool] = []  # per pending row: committed by a step the head
        # did not draft in (its depth-1 prediction was never verified)
        self.shadow_ranks = True  # record those predictions' ranks at catch-up (single_stream)
        self.last_hidden: Tensor | None = None  # [1, 1, H] output of the last committed row
        self.last_logits: Tensor | None = None  # [1, N] its draft logits
        self._unpaid_steps = 0
        # single_stream (None: the serving engine's copies): measured / modelled seconds of
        # plain and of speculative steps, running
        self.step_ratios: dict[str, float] | None = None

    def begin(self, target, prompt_ids, params) -> None:
        if target.model.embed_tokens.num_embeddings != self.head.config.vocab_size:
            raise EyasError("the EAGLE-3 head was trained for a target with another vocabulary")
        self.past, self.committed, self.pending_taps = None, 0, []
        self.last_position, self.next_position, self.pending_positions = -1, 0, []
        self.pending_unverified = []
        self.kv = self.fused.new_cache() if self.fused is not None else None
        self.coupling = None
        self._coupled_probe = None
        self.last_hidden = self.last_logits = None
        self._unpaid_steps = 0
        self._first_step = True  # of this request: not a price (step_seconds)
        self._backlog_seconds = 0.0  # the last catch-up's time over rows of earlier plain steps
        if self.auto:
            self._measured_cost(target)
            self._resize()

    def draw_with(self, coupling) -> None:
        """This request's tokens are Gumbel draws with known noise (coupled_draws.py): rank each
        depth's candidates by the head's logits / T plus the noise of the position they fill."""
        self.coupling = coupling

    def single_stream(self, target, fallback: bool = True) -> None:
        """Decoding one request (speculative_generate): where no tree shape pays, draft a
        one-token probe every 16th step only (the serving engine decides budgets itself;
        sizing the tree is the method itself: `fallback` changes nothing here)."""
        if self.step_ratios is None:
            self.step_ratios = {}

    def step_seconds(self, size: int, seconds: float) -> None:
        """The wall time of one decode step that verified `size` draft nodes (0: a plain step),
        against the cost model's price of it; kept as running ratios (single_stream only)."""
        if self.step_ratios is None or self.cost is None or seconds <= 0:
            return
        if self._first_step:  # right after the prefill (old BENCHMARKS.md section 6h: priced it
            self._first_step = False  # ~25% dear, so that a head that cannot pay drafted)
            return
        if size:
            # a probe after plain steps first caught up their rows: their cost, not this step's
            seconds, self._backlog_seconds = seconds - self._backlog_seconds, 0.0
            kind = "speculative"
            modelled = self.cost.verify(1 + size) + self.cost.tree_draft(self.shape.depth, self.shape.top_k)
        else:
            kind, modelled = "plain", self.cost.verify(1)
        ratio = seconds / modelled
        previous = self.step_ratios.get(kind)
        self.step_ratios[kind] = ratio if previous is None else 0.9 * previous + 0.1 * ratio

    def draft_seconds_per_token(self, target) -> float:
        """One head pass over one row, from the cached cost model (measured here if missing;
        copies made afterwards share it). 0 with a fixed tree, which measures nothing."""
        return self._measured_cost(target).draft(1) if self.auto else 0.0

    def _measured_cost(self, target):
        """The CostModel of this target and head: cached per machine, measured once."""
        if self.cost is None:
            from eyas.engine.speculative.sizing import load_or_measure

            self.cost = load_or_measure(target, self.head)
        return self.cost

    def _resize(self) -> None:
        from eyas.engine.speculative.sizing import choose_shape

        # choose_shape tries every shape (milliseconds of Python); the serving engine's copies of
        # this proposer share the memo, so that each new request does not pay for it again.
        ranks = [round(p, 3) for p in self.ranks.probabilities]
        cost, key, ratios = self.cost, tuple(ranks), self.step_ratios or {}
        if "plain" in ratios and "speculative" in ratios:  # single_stream: as measured here
            factors = (round(ratios["plain"], 2), round(ratios["speculative"], 2))
            cost, key = cost.calibrated(*factors), key + factors
        choice = self.shape_memo.get(key)
        if choice is None:
            if len(self.shape_memo) >= 4096:
                self.shape_memo.clear()
            choice = self.shape_memo[key] = choose_shape(cost, ranks)
        self.choice = choice
        if choice.depth == 0:  # speculation cannot pay: a one-token chain keeps statistics alive
            self.shape = TreeShape(depth=1, top_k=1, total_tokens=2)
        else:
            self.shape = TreeShape(choice.depth, choice.top_k, choice.total_tokens)
        self.steps_since_resize = 0

    # -- what a tree is worth (the serving rule, eyas.scheduler.speculation.TreePricing) ------
    def expected_tokens(self, max_nodes: int) -> float | None:
        """Tokens per step, bonus included, of the tree `propose` drafts under a budget of
        `max_nodes`, from the observed rank statistics; None with a fixed tree (no measured
        costs to price it against)."""
        if not self.auto or self.cost is None or max_nodes < 1:
            return None
        # The serving rule asks for every request and budget each step: one running sum per
        # shape and rank statistics, memoized (and shared by the copies); the statistics'
        # running total tells whether they changed since this copy last asked.
        shape, ranks = self.shape, self.ranks
        state = (id(ranks), ranks.total, shape.depth, shape.top_k)
        if self._priced_state != state:
            from eyas.engine.speculative.sizing import accepted_by_size

            key = (shape.depth, shape.top_k, *(round(p, 3) for p in ranks.probabilities))
            accepted = self.price_memo.get(key)
            if accepted is None:
                if len(self.price_memo) >= 4096:
                    self.price_memo.clear()
                accepted = self.price_memo[key] = accepted_by_size(shape.depth, shape.top_k, list(key[2:]))
            self._priced_state, self._priced_accepted = state, accepted
        accepted = self._priced_accepted
        return 1.0 + accepted[min(shape.total_tokens - 1, max_nodes, len(accepted) - 1)]

    def draft_seconds(self, max_nodes: int) -> float:
        """Modelled seconds of drafting that tree: one head pass per level (the first over one
        row, each further one over top_k rows), from the measured cost model."""
        if self.cost is None or max_nodes < 1:
            return 0.0
        return self.cost.tree_draft(min(self.shape.depth, max_nodes), self.shape.top_k)

    def stats(self) -> dict:
        shape = {"tree": f"{self.shape.depth},{self.shape.top_k},{self.shape.total_tokens}",
                 "tree_mode": "auto" if self.auto else "fixed",
                 "rank_probabilities": [round(p, 3) for p in self.ranks.probabilities]}
        if self.choice is not None:
            shape["expected_tokens_per_step"] = round(self.choice.expected_tokens, 3)
        if self.sharpness.seen:
            shape.update(self.sharpness.stats())
        return shape

    # -- feedback from the target ---------------------------------------------------------
    def observe(self, tree, result, output) -> None:
        """Keep the taps of the rows that became final: all prompt rows after the prefill,
        the root and the accepted nodes after a verification."""
        if result is not None and tree is not None and tree.size:
            self._record_ranks(tree, result)
        if result is not None and self._coupled_probe is not None and self.coupling is not None:
            logits, context = self._coupled_probe  # the draws' first token filled its depth 1
            self.sharpness.learn(self.coupling, logits[None], self.target_ids,
                                 [self.coupling.position(context, 1)], result.emitted[:1])
        self._coupled_probe = None
        if output is None or output.taps is None:
            if result is not None:  # a pass without taps: its rows are left out (a gap)
                self.next_position += 1 + len(result.accepted_nodes)
            return
        if result is None:  # the prefill
            taps = output.taps
        else:
            accepted = list(result.accepted_nodes)
            if accepted == list(range(1, len(accepted) + 1)):  # the root and a chain's first
                taps = output.taps[:, : 1 + len(accepted)]  # nodes (every plain step): a view
            else:
                rows = torch.tensor([0] + accepted, device=output.taps.device)
                taps = output.taps[:, rows]
        # Plain steps (no propose in between) pile up rows; the next catch-up takes them all.
        self.pending_taps.append(taps)
        self.pending_positions.append(self.next_position)
        self.next_position += taps.shape[1]
        unverified = result is not None and not any(self.node_ranks)  # the prompt's rows: no
        self.pending_unverified += [unverified] * taps.shape[1]

    def _shadow_ranks(self, hidden: Tensor, rows: list[int], next_tokens: list[int],
                      next_indices: list[int]) -> None:
        """Rank (1..4, else a miss) of each known next token (at index next_indices[i] of the
        token ids) among the head's draft logits of its row, hidden [1, m, H], ranked as a
        depth-1 draft would have been: what the depth-1 draft of a step the head sat out would
        have scored."""
        logits = self.head.compute_logits(hidden[0, rows])  # [r, N] draft ids
        if self.coupling is not None:
            # the last row teaches the sharpness (~75 us a row: one per catch-up)
            self.sharpness.learn(self.coupling, logits[-1:], self.target_ids,
                                 [self.coupling.position(next_indices[-1], 1)], next_tokens[-1:])
            logits = torch.stack([self._ranking(row, index, 1) for row, index in zip(logits, next_indices)])
        top = self.head.draft_to_target(torch.topk(logits, len(self.ranks.counts), dim=-1).indices)
        for candidates, token in zip(top.tolist(), next_tokens):
            self.ranks.record(candidates.index(token) + 1 if token in candidates else None)
        self._count_toward_resize(len(rows))

    def _count_toward_resize(self, steps: int) -> None:
        if self.auto:
            self.steps_since_resize += steps
            if self.steps_since_resize >= self.resize_every:
                self._resize()

    def _record_ranks(self, tree: DraftTree, result) -> None:
        """Rank of the accepted child at each depth of the path; a miss where it stopped.

        A node of rank 0 was not drafted by the head (another proposer's branch, see
        `renumber`): the path is followed only while the head drafted it.
        """
        parents = tree.parents.tolist()
        head_parents = {parent for parent, rank in zip(parents, self.node_ranks) if rank}
        last = 0
        for node in result.accepted_nodes:
            rank = self.node_ranks[node - 1]
            if not rank:
                break
            self.ranks.record(rank)
            last = node
        if last in head_parents:  # the head drafted children under `last`: none was right
            self.ranks.record(None)
        self._count_toward_resize(1)

    def renumber(self, node_map: list[int], size: int) -> None:
        """The last tree was merged into another one of `size` nodes: node i + 1 of this
        proposer's tree is node node_map[i] there (0: left out); the other nodes get rank 0:
        not the head's."""
        ranks = [0] * size
        for rank, node in zip(self.node_ranks, node_map):
            if node:
                ranks[node - 1] = rank
        self.node_ranks = ranks

    # -- drafting -------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        if self._plain_step_now():
            self.node_ranks = []
            return DraftTree.empty()  # its taps wait for the next catch-up
        self._catch_up(token_ids)
        if max_nodes <= 0 or self.last_logits is None:
            return DraftTree.empty()
        budget = min(self.shape.total_tokens - 1, max_nodes)
        candidates = self._expand(token_ids, budget)
        return self._rerank(candidates, budget)

    def _plain_step_now(self) -> bool:
        """single_stream only: plain steps until one is priced, then, where the sizing chose
        depth 0, every step but each PROBE_EVERY-th, and where it chose a tree, each
        PROBE_EVERY-th step only (which keeps the price of a plain step current)."""
        if self.step_ratios is None or not self.auto:
            return False
        if "plain" not in self.step_ratios:
            return True
        if self.choice is None:
            return False
        self._unpaid_steps += 1
        probe = self._unpaid_steps % self.PROBE_EVERY == 0
        return probe if self.choice.depth else not probe

    def _catch_up(self, token_ids: list[int]) -> None:
        if not self.pending_taps:
            return
        pending, self.pending_taps = self.pending_taps, []
        firsts, self.pending_positions = self.pending_positions, []
        started = time.perf_counter()
        taps = pending[0] if len(pending) == 1 else torch.cat(pending, 1)
        if taps.dtype != self.head.dtype:
            taps = taps.to(self.head.dtype)
        count = taps.shape[1]
        unverified, self.pending_unverified = self.pending_unverified, []
        # the row at position p reads (taps of p, token p + 1): blocks are contiguous inside,
        # with gaps between them where passes computed no taps
        row_positions = [first + i for first, block in zip(firsts, pending) for i in range(block.shape[1])]
        if row_positions[-1] + 1 >= len(token_ids):
            return  # rows need the token one position later; plain steps leave gaps we cannot fill
        ids = [token_ids[p + 1] for p in row_positions]
        hidden = self._head_pass(taps, ids, row_positions, None)  # [1, count, H]
        self.committed += count
        self.last_position = row_positions[-1]
        self.last_hidden = hidden[:, -1:]
        self.last_logits = self._logits(self.last_hidden)  # [1, N]: the last row's only
        if self.shadow_ranks and self.step_ratios is not None:
            # the row at position p predicts token p + 2, known for all rows but the last
            rows = [i for i, flag in enumerate(unverified[: count - 1]) if flag]
            if rows:
                self._shadow_ranks(hidden, rows, [token_ids[row_positions[i] + 2] for i in rows],
                                   [row_positions[i] + 2 for i in rows])
        if len(pending) > 1 and self.cost is not None:
            # the rows of plain steps made this catch-up longer than a drafting step's one-row
            # pass (the modelled draft(1)): step_seconds prices the step without them
            self._backlog_seconds = max(0.0, time.perf_counter() - started - self.cost.draft(1))

    def _expand(self, token_ids: list[int], budget: int) -> list[_Node]:
        shape = self.shape
        device = self.last_logits.device
        context = len(token_ids)
        if self.coupling is not None:
            self._coupled_probe = (self.last_logits[0], context)
        scores = self._ranking(self.last_logits, context, 1)  # [1, N]
        top_values, top_ids = self._top_log_probs(scores, min(shape.top_k, budget))
        d2t = self.d2t
        targets = [i + d2t[i] for i in top_ids[0]]  # head.draft_to_target
        candidates = [_Node(t, -1, s, 1, r + 1) for r, (t, s) in enumerate(zip(targets, top_values[0]))]
        frontier = list(range(len(candidates)))
        row_of: dict[int, int] = {}  # candidate -> its row in `out_hidden`, the last pass's output
        out_hidden = self.last_hidden  # [1, 1, H] the last committed row's (the depth-1 nodes' parent)
        tree_keys: list[int] = []  # candidate id of each tree row in the scratch KV
        for depth in range(2, min(shape.depth, budget) + 1):  # `budget` nodes reach no deeper
            if not frontier:
                break
            # One head pass over the frontier rows: hidden = parent's output, token = node's.
            rows = [row_of.get(candidates[c].parent, 0) for c in frontier]
            hiddens = out_hidden[:, rows[0] : rows[0] + 1] if len(rows) == 1 else out_hidden[:, rows]  # [1, F, H]
            ids = [candidates[c].token for c in frontier]
            position = self.last_position + depth - 1  # a depth-d node's row is at n + d - 1
            mask = self._tree_mask(candidates, frontier, tree_keys, device)
            out_hidden = self._head_pass(hiddens, ids, [position] * len(frontier), mask, scratch=len(tree_keys))
            tree_keys.extend(frontier)
            row_of = {parent: row for row, parent in enumerate(frontier)}
            child_values, child_ids = self._top_log_probs(self._ranking(self._logits(out_hidden), context, depth),
                                                          shape.top_k)  # [F][top_k]
            child_targets = [[i + d2t[i] for i in row] for row in child_ids]
            children: list[int] = []
            for parent, tokens, values in zip(frontier, child_targets, child_values):
                for rank, (token, score) in enumerate(zip(tokens, values)):
                    candidates.append(_Node(token, parent, candidates[parent].score + score, depth, rank + 1))
                    children.append(len(candidates) - 1)
            children.sort(key=lambda c: -candidates[c].score)
            frontier = children[: shape.top_k]
        return candidates

    def _top_log_probs(self, scores: Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
        """The k largest log-probabilities of each row of scores [R, N] float32 (its log-softmax)
        and their draft ids, largest first, as lists [R][k]: torch.topk(torch.log_softmax(scores,
        -1), k), the same numbers in the same order; one C++ call beside the fused head
        (models/csrc/head_output.cpp)."""
        if self.fused is not None:
            return extension.module().log_softmax_top_k(scores, k)
        top = torch.topk(torch.log_softmax(scores, dim=-1), k, dim=-1)
        return top.values.tolist(), top.indices.tolist()

    def _ranking(self, logits: Tensor, context: int, depth: int) -> Tensor:
        """What a depth-`depth` draft's candidates are ranked and scored by, from the head's
        logits [..., N] after a context of `context` tokens: the logits, or where the request's
        tokens are Gumbel draws, the logits / T plus the noise of the position they fill
        (coupled_draws.py), float32."""
        if self.coupling is None:
            return logits if logits.dtype == torch.float32 else logits.float()
        return self.coupling.scores(logits, self.target_ids, self.coupling.position(context, depth),
                                    self.sharpness.value)

    def _head_pass(self, hidden: Tensor, ids: list[int], positions: list[int], mask: Tensor | None,
                   scratch: int | None = None) -> Tensor:
        """One head pass over T rows (hidden [1, T, *], token ids [T]) at `positions` [T] -> their
        outputs [1, T, H].
        Committed rows (scratch None) extend the head's KV; tree rows (scratch = tree rows
        already in the scratch KV) see it without extending it. mask [1, T, committed +
        scratch + T] or None (causal)."""
        if self.fused is not None:
            return self.fused.step(hidden, ids, positions, self.committed + (scratch or 0), self.kv, mask)
        past = self._scratch_past if scratch else self.past  # the first tree level starts anew
        device = hidden.device
        out = self.head(hidden, torch.tensor([ids], device=device), torch.tensor([positions], device=device),
                        attn_mask=mask, past_kv=past, compute_logits=False)
        if scratch is None:
            self.past = out.past_kv
        else:
            self._scratch_past = out.past_kv
        return out.hidden

    def _logits(self, hidden: Tensor) -> Tensor:
        """[1, T, H] -> [T, N] draft logits (`head.compute_logits`; one C++ call on the fused
        path)."""
        if self.fused is not None:
            return self.fused.logits(hidden[0])
        return self.head.compute_logits(hidden)[0]

    def _tree_mask(self, candidates: list[_Node], frontier: list[int], tree_keys: list[int],
                   device: torch.device) -> Tensor | None:
        """[1, F, committed + len(tree_keys) + F]: committed rows, ancestors among earlier tree
        rows, and itself. None on the fused path where that is every slot (a chain): the
        fused layer then sees every slot, which computes the same bits."""
        earlier = len(tree_keys)
        where = {c: i for i, c in enumerate(tree_keys)}
        visible = [[False] * (earlier + len(frontier)) for _ in frontier]  # [F, tree columns]
        for row, node in enumerate(frontier):
            ancestor = candidates[node].parent
            while ancestor >= 0:
                visible[row][where[ancestor]] = True
                ancestor = candidates[ancestor].parent
            visible[row][earlier + row] = True
        if self.fused is not None and len(frontier) == 1 and all(visible[0]):
            return None
        mask = torch.ones(1, len(frontier), self.committed + earlier + len(frontier), dtype=torch.bool,
                          device=device)
        mask[0, :, self.committed :] = torch.tensor(visible, device=device)
        return mask

    def _rerank(self, candidates: list[_Node], budget: int) -> DraftTree:
        order = sorted(range(len(candidates)), key=lambda c: (-candidates[c].score, candidates[c].depth))
        kept = set(order[:budget])
        kept_sorted = sorted(kept, key=lambda c: (candidates[c].depth, -candidates[c].score))
        node_of = {c: i + 1 for i, c in enumerate(kept_sorted)}
        tokens, parents, ranks = [], [], []
        for c in kept_sorted:
            parent = candidates[c].parent
            if parent >= 0 and parent not in node_of:
                continue  # cannot happen with log-probabilities; guards ties
            tokens.append(candidates[c].token)
            parents.append(node_of.get(parent, 0))
            ranks.append(candidates[c].rank)
        self.node_ranks = ranks
        nodes = torch.tensor([tokens, parents], dtype=torch.long)  # [2, N]: one tensor made per step
        return DraftTree(nodes[0], nodes[1])
