"""`StepExecutor`: runs one StepPlan on the target (on the engine's worker thread in overlap
mode). It owns the token-level state of the requests it runs (see request.py).

A step:
1. Drafts: each decoding request's proposer drafts up to its budget under its root (on a
   plain step, a cheap proposer drafts in the shadow: see speculation.py).
2. One target pass over the decoding requests: every request's root + drafts, one after
   another with no padding (a ragged pass, batch.py; a lone request runs the dense pass of its
   own KV row); logits of every query (greedy near-ties recomputed one row at a time).
3. Per row: lossless acceptance (greedy or sampling, eyas.engine.speculative.acceptance),
   compaction of the accepted path in that row's KV, token-level append, proposer.observe.
4. Prefill chunks, one single-row pass each; a prompt's last chunk yields its first token. A
   request that reuses a cached prefix (prefix_cache.py) starts after it; its proposer is
   handed the prefix's taps from the pool, as a prefill would have handed them.

Before anything, the step applies the row copies that admission queued on the pool.

Each request's share of the step runs in a named stage (faults.py): an exception there fails
that request alone (`Request.fail`, listed in `StepResult.failed`); the rest of the batch goes
on. A failure of the shared pass itself is retried one row at a time, so that only the row
that breaks it fails.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from eyas.engine.gumbel import draws_by_screen, inverse_temperature, new_noise_base, noise_key, sample_rows
from eyas.engine.logits_process import NEAR_TIE, process_tree_rows
from eyas.engine.logprobs import token_logprobs
from eyas.engine.sampling import argmax_rows, next_tokens, target_probs
from eyas.engine.speculative import coupled_draws
from eyas.engine.speculative.acceptance import accept_drawn, accept_greedy, accept_sampling
from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.prune import prune_draft
from eyas.engine.speculative.tree import node_depths
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.models.llama import ForwardOutput
from eyas.scheduler.batch import RowInput, build_decode_batch, build_ragged_batch, tree_row
from eyas.scheduler.faults import FaultInjector, InjectedFault, describe
from eyas.scheduler.kv_pool import KVPool
from eyas.scheduler.request import Request, RequestStatus
from eyas.scheduler.scheduler import PrefillChunk, StepPlan
from eyas.scheduler.speculation import SHADOW_SHARE, AcceptanceEstimate, StepCostModel, branch_lesson, shadow_gap

log = logging.getLogger("eyas.engine")

# The tree of a row that drafts nothing this step, shared by every such row (read only):
# building one per row and step was ~30 us a row.
NO_DRAFT = DraftTree.empty()


@dataclass
class StepStats:
    decode_rows: int = 0  # requests decoded in the step's passes
    passes: int = 0  # target passes over decoding rows (one; more where a failed pass is redone)
    queries: int = 0  # rows of the decode pass: every request's root and draft tokens, no padding
    span: int = 0  # KV rows up to the last one decoded
    tokens_per_row: int = 0  # the most queries of one request (1 + its draft tokens)
    planned_draft_tokens: int = 0  # the most draft tokens the scheduler gave a request
    drafts: int = 0  # rows that verified a non-empty draft
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # by depth 1, 2, ...
    prefill_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens of requests that began prefilling (cache on)
    prefix_cache_hits: int = 0  # of those, tokens reused from the prefix cache
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0  # the decode pass (what the cost model follows)
    step_seconds: float = 0.0


@dataclass
class StepResult:
    emitted: list[tuple[Request, list[int]]] = field(default_factory=list)  # in step order
    failed: list[Request] = field(default_factory=list)  # their work raised (Request.failure)
    stats: StepStats = field(default_factory=StepStats)


class StepExecutor:
    def __init__(self, target: Target, pool: KVPool, tap_layers: Sequence[int] = (),
                 costs: StepCostModel | None = None, pooled: AcceptanceEstimate | None = None,
                 prefix_caching: bool = False, single_stream: bool = False) -> None:
        self.target = target
        self.pool = pool
        self.prefix_caching = prefix_caching
        # one request at a time (speculation "timed"): its proposer sizes its own drafts and
        # hears each step's wall time; the request's policy times plain and speculative steps
        self.single_stream = single_stream
        self.tap_layers = tuple(tap_layers)
        self.costs = costs
        self.pooled = pooled or AcceptanceEstimate()  # server-wide acceptance (priors of new requests)
        self.faults = FaultInjector()  # tests inject per-request faults here (faults.py)

    def run(self, plan: StepPlan) -> StepResult:
        """One step of `plan`, in inference mode. The engine's loop enters it once for all its
        steps (Engine.run): entering and leaving it each step cost ~50 us of cold Python after
        a pass (AMD Zen 4), ~1% of a single-stream step."""
        if torch.is_inference_mode_enabled():
            return self._run(plan)
        with torch.inference_mode():
            return self._run(plan)

    def _run(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        self.pool.apply_pending()  # row copies queued by admission (kv_pool.py)
        result = StepResult()
        result.stats.planned_draft_tokens = plan.num_draft_tokens
        decode = [r for r in plan.decode if not r.done and r.root is not None]
        if decode:
            self._decode(decode, plan, result)
        for chunk in plan.prefill:
            if not chunk.request.done:
                self._prefill(chunk, result)
        result.stats.step_seconds = time.perf_counter() - started
        return result

    # ---- decode: one pass over every running request --------------------------------
    def _decode(self, decode: list[Request], plan: StepPlan, result: StepResult) -> None:
        # 1. Drafts (bounded by what max_tokens still allows); shadow drafts on plain steps.
        started = time.perf_counter()
        trees, asked, draft_seconds = self._draft(decode, plan, result)
        decode = [request for request in decode if request.failure is None]
        if not decode:
            return
        drafted = time.perf_counter()
        emitted_before = len(result.emitted)
        # 2-3. One ragged pass, then acceptance row by row. Should the shared pass itself fail
        # (one row's input breaking it), each of its rows is redone alone: only the row that
        # breaks it fails, the others get what they would have got in the batch.
        try:
            self._verify(decode, trees, asked, result)
        except Exception as error:
            if len(decode) == 1:
                self._failed(decode[0], "verify", error, result)
            else:
                log.warning("a batched pass failed (%s); redoing its %d rows one at a time",
                            describe(error), len(decode))
                for request in decode:
                    try:
                        self._verify([request], trees, asked, result)
                    except Exception as row_error:
                        self._failed(request, "verify", row_error, result)
        # 4. Each request's seconds: its own drafting, and the pass it waited for.
        finished = time.perf_counter()
        for request, emitted in result.emitted[emitted_before:]:
            self._timed(request, trees[request.row], len(emitted), draft_seconds.get(request.row, 0.0),
                        finished - drafted, finished - started)

    def _timed(self, request: Request, tree: DraftTree, emitted: int, draft_seconds: float,
               verify_seconds: float, step_seconds: float) -> None:
        metrics = request.spec_metrics
        if tree.size:
            metrics.draft_seconds += draft_seconds
            metrics.verify_seconds += verify_seconds
        else:
            metrics.plain_seconds += step_seconds
        if not self.single_stream:
            return
        step_clock = getattr(request.proposer, "step_seconds", None)  # EAGLE-3 sizing
        if step_clock is not None:
            step_clock(tree.size, step_seconds)
        if request.timing is not None:
            if tree.size:
                request.timing.record_speculative(step_seconds, emitted)
            else:
                request.timing.record_plain(step_seconds)

    def _draft(self, decode: list[Request], plan: StepPlan, result: StepResult
               ) -> tuple[dict[int, DraftTree], set[int], dict[int, float]]:
        """Each request's draft tree by row, the rows whose proposer was asked for one, and
        the seconds each of those spent drafting."""
        drafting_started = time.perf_counter()
        trees: dict[int, DraftTree] = {}
        asked: set[int] = set()
        seconds: dict[int, float] = {}
        steady = plan.max_draft_tokens + 1  # the most tokens one step emits per request
        span = len(decode)  # sequences of a plain pass
        for request in decode:
            remaining = request.max_new_tokens - request.num_output - 1
            budget = min(plan.draft_budget(request), remaining)
            trees[request.row] = NO_DRAFT
            try:
                if budget > 0 and request.proposer is not None:
                    asked.add(request.row)
                    request.shadow.clear()
                    asked_at = time.perf_counter()
                    trees[request.row] = self._propose(request, budget, steady, priced=True)
                    seconds[request.row] = time.perf_counter() - asked_at
                elif self._shadow_allowed(request, plan, span) and remaining > 0:
                    shadow = self._propose(request, min(plan.max_draft_tokens, remaining), steady)
                    if shadow.size:
                        drafted_nodes = getattr(request.proposer, "drafted_nodes", None)
                        request.shadow.start(shadow, drafted_nodes() if drafted_nodes else None)
                    else:
                        self._observe_acceptance(request, 0, 0)  # nothing to draft here
            except Exception as error:
                self._failed(request, "draft", error, result)
        result.stats.draft_seconds += time.perf_counter() - drafting_started
        return trees, asked, seconds

    def _verify(self, decode: list[Request], trees: dict[int, DraftTree], asked: set[int],
                result: StepResult) -> None:
        """One pass over `decode` (ragged: each request's root and drafts, no padding), then
        acceptance for each request."""
        if len(decode) == 1 and self._verify_one(decode[0], trees, asked, result):
            return
        stats = result.stats
        inputs = [RowInput(r.row, r.context_length, r.root, trees[r.row]) for r in decode]
        model = self.target.model
        # 2. The pass. A lone request: the dense pass over its own KV row (single-stream
        # decoding's form, the same bits); several: one ragged pass over the pool's rows.
        if len(decode) == 1:
            row = decode[0].row
            batch = build_decode_batch([RowInput(0, inputs[0].context_length, inputs[0].root, inputs[0].tree)],
                                       self.target.device)
            rows = (row, row + 1)
        else:
            batch = build_ragged_batch(inputs, self.target.device)
            rows = (0, self.pool.rows)
        self.pool.ensure_slots(batch.kv_len)
        forward_started = time.perf_counter()
        output = model(batch.input_ids, batch.positions, cache=self.pool.view(*rows),
                       kv_len=batch.kv_len, **batch.pass_arguments(),
                       tap_layers=self.tap_layers if self._taps_read(decode, trees) else (),
                       logits_at=None)
        hidden = output.hidden[0]  # [N, H]: every query of the pass, request after request
        spans = [(request, offset, item.size) for request, offset, item in zip(decode, batch.offsets, inputs)]
        # A screening output layer gives each row's argmax exactly, whichever rows share the
        # pass (models/output_layer.py); otherwise near-ties of greedy rows are settled alone.
        # Rows whose every logit is read (processors, logprobs) get the full product.
        # Plain-temperature rows draw their tokens through the screen too (engine/gumbel.py);
        # their logits are not read.
        drawn: list[tuple[Request, int, int]] = []
        others: list[tuple[Request, int, int]] = []
        for span in spans:
            by_draw = span[0].noise_base is not None and trees[span[0].row].draft_probs is None
            (drawn if by_draw else others).append(span)
        screened = all(span[0].params.greedy for span in others) and hasattr(model.lm_head, "greedy_logits")
        # Greedy rows whose logits are read as they are (no processors): the argmax of every
        # query of the pass in one call, not one call per row (~35 us a row of call overhead).
        argmax_read = {span[0].row for span in others if self._argmax_only(span[0], trees[span[0].row])}
        # Where every such row reads nothing but its argmax, the screen gives them as ints and
        # no [N, V] logits are made (the drawn rows' entries go unread).
        lean = screened and bool(others) and all(
            span[0].row in argmax_read and not span[0].needs_full_logits for span in others)
        logits: Tensor | None = None
        if lean:
            choices = model.greedy_tokens(hidden)  # [N]
        else:
            logits = (model.output_logits(hidden, greedy=screened) if others
                      else hidden.new_empty(hidden.shape[0], 0))  # [N, V]
        draws = self._draws_isolated(drawn, trees, hidden, result)
        full = [span for span in others if span[0].needs_full_logits] if screened else others
        if screened and full:
            index = torch.cat([torch.arange(offset, offset + size) for _, offset, size in full])
            logits[index] = model.output_logits(hidden[index])
        if full:
            self._settle_near_ties(full, hidden, logits)
        if not lean:
            choices = argmax_rows(logits).tolist() if argmax_read else []  # [N]
        forward_seconds = time.perf_counter() - forward_started
        queries = hidden.shape[0]
        stats.forward_seconds += forward_seconds
        stats.decode_rows += len(decode)
        stats.passes += 1
        stats.queries += queries
        stats.span = max(stats.span, max(r.row for r in decode) + 1)
        stats.tokens_per_row = max(stats.tokens_per_row, max(item.size for item in inputs))
        if self.costs is not None:
            self.costs.observe_ragged(len(decode), queries, forward_seconds)
        # 3. Acceptance, KV compaction and token-level state, request by request.
        # Each row's slices only where something reads them (a slice is a small op, ~20 us
        # cold after a pass): logits where neither its draws nor its argmax stand for them,
        # hidden states for its proposer or processors, taps where the pass made them.
        for request, offset, size in spans:
            if request.failure is not None:  # its draw failed (_draws_isolated)
                continue
            row_draws = draws.get(request.row)
            row_choices = choices[offset : offset + size] if request.row in argmax_read else None
            read = logits is not None and (row_draws is None and row_choices is None or request.logits_processors
                                           or request.params.logprobs is not None)
            row_logits = logits[offset : offset + size][None] if read else None  # [1, N_row, V]
            observed = request.proposer is not None or bool(request.logits_processors)
            row_hidden = output.hidden[:, offset : offset + size] if observed else None
            taps = output.taps[:, offset : offset + size] if output.taps is not None else None
            row_output = ForwardOutput(logits=row_logits, hidden=row_hidden, taps=taps)
            self._accept(request, trees[request.row], row_output, request.row in asked, result,
                         row_draws, row_choices)

    def _verify_one(self, request: Request, trees: dict[int, DraftTree], asked: set[int],
                    result: StepResult) -> bool:
        """A lone request's step (its root and its draft) whose rows are read only by their
        argmax (greedy, no processors or logprobs) or by Gumbel draws through the screen
        (plain temperature, drafts without draft probabilities), through the model's
        `decode_one` / `decode_rows`: what the general path below computes for it, with the
        same calls into the fused stack and the output screen, without building a batch in
        PyTorch. False (nothing done) where it does not apply; the general path then runs."""
        tree = trees[request.row]
        model = self.target.model
        drawn = request.noise_base is not None and tree.draft_probs is None
        argmax = (self._argmax_only(request, tree) and request.noise_base is None
                  and not request.needs_full_logits and hasattr(model, "greedy_tokens"))
        if not (drawn or argmax) or not hasattr(model, "decode_rows"):
            return False
        context, size = request.context_length, 1 + tree.size
        self.pool.ensure_slots(context + size)
        taps = self.tap_layers if self._taps_read([request], trees) else ()
        view = self.pool.view(request.row, request.row + 1)
        forward_started = time.perf_counter()
        if tree.size:
            tokens, positions, mask = tree_row(request.root, tree, context)
            output = model.decode_rows(tokens, positions, context, mask, view, taps)
        else:
            output = model.decode_one(request.root, context, view, taps)
        if output is None:
            return False
        draws, choices = None, None
        if drawn:  # the rows' tokens drawn through the screen; their logits are not read
            draws = self._draws_isolated([(request, 0, size)], trees, output.hidden, result).get(request.row)
        else:  # each row's argmax, exact; no logits come out
            choices = model.greedy_tokens(output.hidden)
        forward_seconds = time.perf_counter() - forward_started
        stats = result.stats
        stats.forward_seconds += forward_seconds
        stats.decode_rows += 1
        stats.passes += 1
        stats.queries += size
        stats.span = max(stats.span, request.row + 1)
        stats.tokens_per_row = max(stats.tokens_per_row, size)
        if self.costs is not None:
            self.costs.observe_ragged(1, size, forward_seconds)
        if request.failure is not None:  # its draw failed (_draws_isolated)
            return True
        self._accept(request, tree, output, request.row in asked, result, draws, choices)
        return True

    def _taps_read(self, decode: list[Request], trees: dict[int, DraftTree]) -> bool:
        """Whether any proposer will read this pass's taps. Not where one timed request takes a
        plain step and its fallback keeps the next one plain too (policy.plain_next), with a
        proposer that can leave those rows out (`taps_optional`, EAGLE-3): the taps' copies out
        of the target's stack and the head's catch-up over their rows would be paid for rows
        never drafted from."""
        if not self.tap_layers or not self.single_stream or self.pool.keep_taps:
            return bool(self.tap_layers)
        return any(trees[request.row].size or request.timing is None or not request.timing.plain_next()
                   or not getattr(request.proposer, "taps_optional", False) for request in decode)

    def _draws_isolated(self, drawn: list[tuple[Request, int, int]], trees: dict[int, DraftTree],
                        hidden: Tensor, result: StepResult) -> dict[int, list[int]]:
        """The draws of `drawn` in one call; where that call raises, each request's alone, so
        that a failing draw ends its own request only (faults stay local, scheduler/faults.py)."""
        try:
            for request, _, _ in drawn:
                self.faults.check(request, "sample")
            return self._draw(drawn, trees, hidden)
        except Exception:
            draws: dict[int, list[int]] = {}
            for span in drawn:
                try:
                    self.faults.check(span[0], "sample")
                    draws.update(self._draw([span], trees, hidden))
                except Exception as error:
                    self._failed(span[0], "sample", error, result)
            return draws

    def _draw(self, drawn: list[tuple[Request, int, int]], trees: dict[int, DraftTree], hidden: Tensor
              ) -> dict[int, list[int]]:
        """The Gumbel draws of `drawn`'s requests (request, offset of its first query in the
        pass, queries) in one call (engine/gumbel.py): for each (by KV row), one token per tree
        position, each with its output position's noise. hidden [N, H] (or [1, N, H])."""
        if not drawn:
            return {}
        index, scales, keys = [], [], []
        for request, offset, _ in drawn:
            depths = [0] + node_depths(trees[request.row])  # the root row, then each node
            index += range(offset, offset + len(depths))
            scales += [inverse_temperature(request.params.temperature)] * len(depths)
            keys += [noise_key(request.noise_base, request.num_output + depth) for depth in depths]
        lm_head = self.target.model.lm_head
        whole = hidden.numel() == len(index) * hidden.shape[-1] and index == list(range(len(index)))
        if whole and hasattr(lm_head, "sample_token_ids"):  # every row of the pass, in order
            tokens = lm_head.sample_token_ids(hidden, scales, keys)
        else:
            rows = hidden.reshape(-1, hidden.shape[-1])[torch.tensor(index)]
            tokens = sample_rows(lm_head, rows, torch.tensor(scales, dtype=torch.float32),
                                 torch.tensor(keys)).tolist()
        draws, at = {}, 0
        for request, _, size in drawn:
            draws[request.row], at = tokens[at : at + size], at + size
        return draws

    @staticmethod
    def _argmax_only(request: Request, tree: DraftTree) -> bool:
        """A greedy row whose acceptance reads nothing but the argmax of its raw logits."""
        return request.params.greedy and not request.logits_processors and tree.draft_probs is None

    def _accept(self, request: Request, tree: DraftTree, row_output: ForwardOutput, asked: bool,
                result: StepResult, draws: list[int] | None = None,
                choices: list[int] | None = None) -> None:
        """One row after the pass: verify its draft, draw its next token, compact its KV row,
        append at token level, let its proposer read the pass. `draws`: the row's Gumbel draws
        (plain-temperature rows: their logits are not read); `choices`: the argmax of each of
        its raw logits rows, computed for the whole pass (greedy rows, `_argmax_only`). The
        row's logits may be None where `draws` or `choices` are given (nothing else reads them)."""
        row_logits = None if row_output.logits is None else row_output.logits[0]  # [N_row, V]
        stage = "verify"
        try:
            self.faults.check(request, "verify")
            if request.logits_processors:  # every tree position, with the path to it
                hidden = row_output.hidden[0]  # [N_row, H]
                model = self.target.model
                recompute = ((lambda index: model.output_logits(hidden[index][None, None])[0, 0])
                             if request.params.greedy else None)
                row_logits = process_tree_rows(row_logits, request.logits_processors,
                                               request.output_ids, tree, recompute)
            sampled = not request.params.greedy and draws is None  # from full probabilities
            probs = target_probs(row_logits, request.params) if sampled else None
            stage = "sample"
            self.faults.check(request, "sample")
            if draws is not None:
                verdict = accept_drawn(tree, draws)
            elif choices is not None:  # accept_greedy's rule on the argmax taken for the pass
                verdict = accept_drawn(tree, choices)
            elif probs is None:
                verdict = accept_greedy(tree, row_logits)
            else:
                verdict = accept_sampling(tree, probs, request.generator)
            stage = "verify"
            context = request.context_length
            if verdict.accepted_nodes:
                self.pool.cache.compact(request.row, [context + node for node in verdict.accepted_nodes],
                                        start=context + 1)
            if self.pool.keep_taps and row_output.taps is not None:
                kept = torch.tensor([0] + list(verdict.accepted_nodes), device=row_output.taps.device)
                self.pool.write_taps(request.row, context, row_output.taps[0, kept])
            request.context_length = context + 1 + len(verdict.accepted_nodes)
            request.root = verdict.next_token
            request.append_tokens(verdict.emitted, request.sequence.eos_token_ids)
            if request.params.logprobs is not None:  # raw rows: the root's, then each accepted node's
                rows = [0] + verdict.accepted_nodes
                request.output_logprobs += token_logprobs(row_output.logits[0][rows], verdict.emitted,
                                                          request.params.logprobs)
            if request.proposer is not None:
                stage = "draft"
                self.faults.check(request, "draft")
                request.proposer.observe(tree, verdict, row_output)
                self._sync_proposer(request)
            self._record(request, tree, verdict, asked, result.stats)
        except Exception as error:
            self._failed(request, stage, error, result)
            return
        result.emitted.append((request, verdict.emitted))

    def _failed(self, request: Request, stage: str, error: Exception, result: StepResult) -> None:
        """This request's work raised at `stage`: it alone ends (finish_reason 'error')."""
        if isinstance(error, (InjectedFault, EyasError)):  # a test's fault, a user's mistake
            log.error("%s failed at %s: %s", request.request_id, stage, error)
        else:
            log.exception("%s failed at %s; it alone ends", request.request_id, stage)
        request.fail(stage, describe(error), error)
        result.failed.append(request)

    def _settle_near_ties(self, spans: list[tuple[Request, int, int]], hidden: Tensor, logits: Tensor) -> None:
        """Greedy rows whose top two logits are within NEAR_TIE: recompute them one row at a
        time, as single-request decoding does. A float32 matmul's rounding depends on how many
        rows it multiplies (about 1e-5 on these logits), which can flip an argmax at a near-tie;
        this removes the output layer's share of that (attention over a padded KV length keeps
        a smaller one, see docs/serving.md). Costs one top-2 per step and, rarely, one row.
        `spans`: (request, its first query among hidden [N, H] / logits [N, V], its count)."""
        greedy = [(offset, size) for request, offset, size in spans if request.params.greedy]
        if not greedy:
            return
        top = logits.topk(2, dim=-1).values  # [N, 2]
        close = ((top[:, 0] - top[:, 1]) < NEAR_TIE).nonzero().flatten().tolist()
        if not close:
            return
        greedy_rows = set()
        for offset, size in greedy:
            greedy_rows.update(range(offset, offset + size))
        lm_head = self.target.model.lm_head
        for index in close:
            if index in greedy_rows:
                logits[index] = lm_head(hidden[index][None, None])[0, 0]

    def _propose(self, request: Request, budget: int, steady_backlog: int,
                 priced: bool = False) -> DraftTree:
        """Ask the proposer for a tree of at most `budget` nodes and time it. A proposer with
        its own cache (EAGLE-3, a draft model, layer-skip) first catches up over every token
        since it was last asked: the whole prompt on the first call, several steps' worth
        after plain steps. Such a call is not a sample of what drafting costs per step, so its
        time is recorded only when the backlog is what one step can emit (`steady_backlog`).
        `priced`: the tree will be verified; the accepted tokens its proposer expects of it
        are kept for the calibration of its price (speculation.py)."""
        self.faults.check(request, "draft")
        backlog = len(request.token_ids) - request.proposed_through
        pricing = request.acceptance.tree
        request.acceptance.pending_expected = None
        if priced and pricing is not None:
            expected = pricing.expected_tokens(budget)
            if expected is not None:
                request.acceptance.pending_expected = expected - 1.0
        asked_at = time.perf_counter()
        tree = request.proposer.propose(request.token_ids, budget)
        # drafts a grammar forbids are never verified (prune.py)
        tree = prune_draft(request.proposer, tree, request.logits_processors, request.output_ids, budget)
        seconds = time.perf_counter() - asked_at
        request.proposed_through = len(request.token_ids)
        if backlog <= steady_backlog:
            request.acceptance.record_draft_time(seconds, budget)
            self.pooled.record_draft_time(seconds, budget)
            pricing = request.acceptance.tree
            if pricing is not None and pricing.expected_tokens(budget) is not None:
                modelled = pricing.draft_seconds(budget)
                request.acceptance.record_draft_calibration(seconds, modelled)
                self.pooled.record_draft_calibration(seconds, modelled)
        return tree

    @staticmethod
    def _sync_proposer(request: Request) -> None:
        """A proposer that prices the request's text as it is now (suffix decoding) follows
        every token, drafted or not: otherwise a request the rule kept plain would be priced
        from before its last plain steps, and never drafted again."""
        sync = getattr(request.proposer, "sync", None)
        if sync is not None:
            sync(request.token_ids)

    def _shadow_allowed(self, request: Request, plan: StepPlan, span: int) -> bool:
        """Shadow drafts only where acceptance drives decisions (auto mode), at most one in
        flight per request, and costing at most SHADOW_SHARE of the request's plain steps: a
        proposer dearer than that share of one step drafts in the shadow once every few plain
        steps (`shadow_gap`; suffix decoding in a step of 16 requests: ~30-200 us a draft
        against ~21 us, the share of a row's ~1 ms)."""
        if request.proposer is None or self.costs is None or plan.max_draft_tokens < 1:
            return False
        shadow = request.shadow
        if shadow.active:
            return False
        if shadow.wait > 0:
            shadow.wait -= 1
            return False
        cost = request.acceptance.draft_seconds_per_token * plan.max_draft_tokens
        gap = shadow_gap(cost, SHADOW_SHARE * self.costs.cost(span, 1) / span)
        if gap is None:
            return False
        shadow.wait = gap - 1
        return True

    def _observe_acceptance(self, request: Request, drafted: int, accepted: int) -> None:
        request.acceptance.record(drafted, accepted)
        self.pooled.record(drafted, accepted)

    def _record(self, request: Request, tree: DraftTree, verdict, asked: bool, stats: StepStats) -> None:
        accepted = len(verdict.accepted_tokens)
        expected = request.acceptance.pending_expected
        if asked and expected is not None:  # the calibration of tree prices
            request.acceptance.record_tree(expected, accepted)
            self.pooled.record_tree(expected, accepted)
            request.acceptance.pending_expected = None
        if tree.size:
            depths = node_depths(tree)
            request.spec_metrics.record(tree, depths, verdict)
            self._observe_acceptance(request, max(depths), accepted)
            stats.drafts += 1
            stats.draft_tokens += tree.size
            stats.accepted_tokens += accepted
            if accepted > len(stats.accepted_per_position):
                stats.accepted_per_position += [0] * (accepted - len(stats.accepted_per_position))
            for depth in range(accepted):
                stats.accepted_per_position[depth] += 1
            return
        request.spec_metrics.plain_steps += 1
        if asked:
            self._observe_acceptance(request, 0, 0)  # asked, found nothing to draft
        elif request.shadow.active:
            shadow = request.shadow
            branch, nodes = shadow.branch, shadow.nodes
            outcome = shadow.follow(verdict.emitted)
            if outcome is not None:
                self._observe_acceptance(request, *outcome)
                if nodes is not None:  # what verifying the first branch would have taught
                    request.proposer.learn(*branch_lesson(nodes, branch, outcome[1]))
        else:
            request.acceptance.relax()

    # ---- prefill: one chunk of one prompt -------------------------------------------
    def _begin(self, request: Request, stats: StepStats) -> None:
        """Before the first chunk: the request's sampler and proposer; a proposer that reads
        the target's taps gets those of the reused prefix (slots [0, context_length))."""
        request.prefill_started = True
        request.generator = request.params.generator(self.target.device)
        if draws_by_screen(request.params, request.needs_full_logits):
            request.noise_base = new_noise_base(request.generator)
        if self.prefix_caching:
            stats.prefix_cache_queries += request.prompt_len
            stats.prefix_cache_hits += request.context_length
        if request.proposer is None:
            return
        if self.single_stream and hasattr(request.proposer, "single_stream"):
            fallback = request.timing is None or request.timing.config.enabled
            request.proposer.single_stream(self.target, fallback)  # priced n-grams and chains, EAGLE-3 probes
        request.proposer.begin(self.target, request.prompt_ids, request.params)
        if request.noise_base is not None and hasattr(request.proposer, "draw_with") and coupled_draws.enabled():
            # its drafts ranked with the noise the target will draw with (coupled_draws.py)
            request.proposer.draw_with(coupled_draws.CoupledDraws(
                inverse_temperature(request.params.temperature), request.noise_base, request.prompt_len))
        reused = request.context_length
        if reused and self.tap_layers:
            taps = self.pool.read_taps(request.row, reused)  # [1, reused, W]
            if taps is None or taps.shape[1] != reused:
                raise RuntimeError("the prefix cache holds no taps for the reused prefix")
            request.proposer.observe(DraftTree.empty(), None, ForwardOutput(None, None, taps))

    def _prefill(self, chunk: PrefillChunk, result: StepResult) -> None:
        request, start, end = chunk.request, chunk.start, chunk.end
        target = self.target
        stage = "prefill"
        try:
            self.faults.check(request, "prefill")
            start = min(start, request.context_length)  # a reused prefix may come out shorter
            if not request.prefill_started:
                self._begin(request, result.stats)
            self.pool.ensure_slots(end)
            row = request.row
            ids = torch.tensor([request.prompt_ids[start:end]], device=target.device)  # [1, C]
            greedy = request.params.greedy and not request.needs_full_logits
            prompt_logprobs = request.params.prompt_logprobs
            # a screen-drawn request draws its first token as every later one (output position
            # 0's noise): no logits of the prompt's last row, so no full product over the
            # vocabulary (nor the float table a lean output layer would build for it)
            drawn = request.noise_base is not None
            last = "last" if chunk.final and not drawn else None
            logits_at = "all" if prompt_logprobs is not None else last
            output = target.model(ids, cache=self.pool.view(row, row + 1), write_at=start,
                                  kv_len=end, logits_at=logits_at, tap_layers=self.tap_layers,
                                  greedy=greedy)
            if prompt_logprobs is not None:  # position p predicts prompt token p + 1
                self._prompt_logprobs(request, output.logits[0], start, end)
            request.context_length = end
            result.stats.prefill_tokens += end - start
            if self.pool.keep_taps and output.taps is not None:
                self.pool.write_taps(row, start, output.taps[0])
            if request.proposer is not None:
                stage = "draft"
                request.proposer.observe(DraftTree.empty(), None, output)
            if not chunk.final:
                return
            stage = "sample"
            self.faults.check(request, "sample")
            if drawn:
                token = int(sample_rows(target.model.lm_head, output.hidden[0, -1:],
                                        torch.tensor([inverse_temperature(request.params.temperature)]),
                                        torch.tensor([noise_key(request.noise_base, 0)]))[0])
            else:
                last_logits = process_tree_rows(output.logits[:, -1], request.logits_processors, [],
                                                DraftTree.empty())  # [1, V]
                token = int(next_tokens(last_logits, request.params, request.generator)[0])
            if request.params.logprobs is not None:
                request.output_logprobs += token_logprobs(output.logits[0, -1:], [token],
                                                          request.params.logprobs)
        except Exception as error:
            self._failed(request, stage, error, result)
            return
        request.root = token
        request.append_tokens([token], request.sequence.eos_token_ids)
        if request.proposer is not None:
            self._sync_proposer(request)
        if request.status == RequestStatus.PREFILLING:
            request.status = RequestStatus.DECODING
        result.emitted.append((request, [token]))

    @staticmethod
    def _prompt_logprobs(request: Request, logits: Tensor, start: int, end: int) -> None:
        """A prompt chunk's logits [C, V] (positions start..end-1) -> the logprobs of prompt
        tokens start+1..end (the last chunk's last row predicts the first output token)."""
        prompt = request.prompt_ids
        if start == 0:
            request.prompt_logprobs = [None]
        upto = min(end, len(prompt) - 1)  # positions whose next token is in the prompt
        request.prompt_logprobs += token_logprobs(logits[: upto - start], prompt[start + 1 : upto + 1],
                                                  request.params.prompt_logprobs)
