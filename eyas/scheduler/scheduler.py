"""`Scheduler`: waiting and running queues -> one `StepPlan` per step.

Each step, in order:
1. Decode: every running request whose prompt is (or will be, by the step in flight) fully
   prefilled gets one row of the step's target pass(es): its root plus up to its own number
   of drafts, chosen per row by the speculation policy (draft_plan.py, speculation.py).
2. Prefill: what is left of the step's token budget (`max_step_tokens`) goes to prompt chunks
   (at most `prefill_chunk` tokens per request per step), oldest request first, so that a long
   prompt never stalls the running requests for more than one chunk. While requests decode,
   the prompt tokens are also priced with the measured cost model (speculation.StepCostModel):
   the step may take at most `prefill_stretch` times its plain decode pass, and at least
   MIN_PREFILL_TOKENS prompt tokens go in, so that every prompt progresses. Prefill chunks cost
   each decoding request time per output token (TPOT); smaller ones delay the joining
   request's first token (TTFT) instead.
3. Admission: waiting requests (first come, first served) take a free KV row while the budget
   lasts. A row is the request's KV memory: admission needs one that no request holds. With a
   prefix cache (prefix_cache.py), a request reuses the longest computed prefix of its prompt
   (a cached row, or a running request's prompt) and prefills only the rest; one whose prompt
   shares more with a prompt still prefilling waits for it (requests behind it may pass).

The plan names requests, not rows: rows are read when the step runs, after the engine has
released finished requests and packed the pool (moves happen only between steps: admission
queues its copies on the pool, which the loop thread applies before the step runs).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from eyas.scheduler.config import EngineConfig
from eyas.scheduler.kv_pool import KVPool
from eyas.scheduler.prefix_cache import PrefixCache
from eyas.scheduler.request import Request, RequestStatus
from eyas.scheduler.draft_plan import choose_draft_budgets
from eyas.scheduler.speculation import AcceptanceEstimate, StepCostModel, tree_pricing

MIN_PREFILL_TOKENS = 32  # prefill progress per step even when decoding fills the budget
PLAIN_PROBE_EVERY = 16  # while speculating, every 16th step is plain: it re-measures c(B, 1)
DRAFT_PROBE_EVERY = 32  # while plain, a draft probe after 32 plain steps, then 64, 128, ...
DRAFT_PROBE_MAX_GAP = 1024  # ... up to 1024 while probes keep finding that drafting does not pay
DRAFT_PROBE_SHARE = 0.01  # and never so often that the probe's extra token costs over 1% overall
# After IDLE_PLANS priced steps in a row that chose no draft, the rows are priced only every
# IDLE_PRICE_EVERY-th step (the steps between are plain): pricing 16 suffix-decoding rows took
# ~1.3 ms of a 17-20 ms step on a 2-core Zen 4, at a batch size where no draft pays.
IDLE_PLANS = 8
IDLE_PRICE_EVERY = 4


@dataclass
class PrefillChunk:
    request: Request
    start: int  # first prompt token of the chunk
    end: int  # one past the last

    @property
    def final(self) -> bool:
        return self.end == self.request.prompt_len


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)  # one row each: root + drafts
    num_draft_tokens: int = 0  # the most draft tokens any request gets (0 = plain decoding)
    max_draft_tokens: int = 0  # the most k could have been (shadow drafts use it; 0 = none)
    prefill: list[PrefillChunk] = field(default_factory=list)
    # draft tokens per request_id where they differ by request; None: num_draft_tokens each
    draft_budgets: dict[str, int] | None = None

    def draft_budget(self, request: Request) -> int:
        if self.draft_budgets is None:
            return self.num_draft_tokens
        return self.draft_budgets.get(request.request_id, 0)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, speculative: bool,
                 costs: StepCostModel | None = None, pooled: AcceptanceEstimate | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.config = config
        self.pool = pool
        self.prefix_cache = prefix_cache  # None: every prompt is prefilled whole
        self.speculative = speculative and config.speculation != "never"
        self.costs = costs
        self.pooled = pooled  # server-wide acceptance: the priors of newly admitted requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, in admission order
        self._admitted = 0
        self._dropped: list[Request] = []
        self._speculative_steps = 0
        self._plain_streak = 0  # plain steps since the last speculative step or draft probe
        self._probe_gap = DRAFT_PROBE_EVERY  # plain steps before the next draft probe
        self._idle_plans = 0  # priced steps in a row whose plan drafted nothing
        self._unpriced = 0  # steps since the rows were last priced
        self.last_draft_tokens = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    # ---- the plan --------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        live = [r for r in self.running if not r.done]
        plan.decode = [r for r in live if r.prefill_complete_scheduled]
        prefilling = [r for r in live if not r.prefill_complete_scheduled]
        prefill_pending = bool(prefilling or self.waiting)
        # prompt tokens each running request will have computed when this step starts
        available = {r: r.prefill_scheduled for r in live}
        # 1. Decode rows and the step's draft length.
        plan.draft_budgets, plan.max_draft_tokens = self._draft_budgets(plan.decode, prefill_pending)
        if plan.draft_budgets is not None:
            plan.num_draft_tokens = max(plan.draft_budgets.values(), default=0)
        self.last_draft_tokens = plan.num_draft_tokens
        queries = sum(1 + plan.draft_budget(r) for r in plan.decode)
        budget = self.config.max_step_tokens - queries
        if prefill_pending:
            budget = min(budget, self.priced_prefill_tokens(len(plan.decode)))
            budget = max(budget, min(self.config.prefill_chunk, MIN_PREFILL_TOKENS))
        # 2. Chunks of prompts already admitted, oldest first.
        for request in prefilling:
            budget -= self._add_chunk(plan, request, budget)
            if budget <= 0:
                return plan
        # 3. Admission while a row and budget are left.
        passed: list[Request] = []  # waiting for a prompt still prefilling (prefix cache)
        while self.waiting and budget > 0 and self.pool.num_free > 0:
            request = self.waiting.popleft()
            if request.done:  # cancelled while waiting: the engine finishes it
                self._dropped.append(request)
                continue
            if self.prefix_cache is None:
                request.row = self.pool.allocate(request)
            else:
                match = self.prefix_cache.match(request, self.running, available)
                if match.wait:
                    passed.append(request)
                    continue
                request.row = self.prefix_cache.admit(request, match)
                request.prefill_scheduled = match.length
                available[request] = match.length
            request.status = RequestStatus.PREFILLING
            if self.pooled is not None:
                request.acceptance = self.pooled.seeded()
            request.acceptance.tree = tree_pricing(request.proposer)
            request.admitted_order = self._admitted
            self._admitted += 1
            self.running.append(request)
            budget -= self._add_chunk(plan, request, budget)
        self.waiting.extendleft(reversed(passed))
        return plan

    def priced_prefill_tokens(self, sequences: int) -> int:
        """The most prompt tokens a step may add to the decode pass of `sequences` requests:
        prefilling them (one chunk, c(1, P) of the cost model) may cost at most
        (prefill_stretch - 1) x their plain pass c(B, 1), drafts or not (rows that draft
        must not buy the others a longer stall). No limit when nothing decodes, without a
        cost model or with prefill_stretch None (the token budget alone then limits prefill)."""
        stretch = self.config.prefill_stretch
        if not sequences or self.costs is None or stretch is None:
            return self.config.max_step_tokens
        allowance = (stretch - 1.0) * self.costs.ragged_cost(sequences, sequences)
        low, high = 0, self.config.max_step_tokens  # the largest P with c(1, P) <= allowance
        while low < high:
            middle = (low + high + 1) // 2
            if self.costs.ragged_cost(1, middle) <= allowance:
                low = middle
            else:
                high = middle - 1
        return low

    def _add_chunk(self, plan: StepPlan, request: Request, budget: int) -> int:
        start = request.prefill_scheduled
        size = min(self.config.prefill_chunk, request.prompt_len - start, budget)
        if size <= 0:
            return 0
        plan.prefill.append(PrefillChunk(request, start, start + size))
        request.prefill_scheduled = start + size
        return size

    def _draft_budgets(self, decode: list[Request], prefill_pending: bool
                       ) -> tuple[dict[str, int], int]:
        """(draft tokens per request_id for this step, the cap they were chosen under)."""
        if not self.speculative or not decode:
            return {}, 0
        budget = self.config.max_step_tokens // (2 if prefill_pending else 1)  # queries in all
        most = min(self.config.num_draft_tokens, budget - len(decode))  # one row's cap
        even = min(most, budget // len(decode) - 1)  # every row alike
        if most < 1:
            return {}, 0
        every = lambda k: {r.request_id: k for r in decode}  # noqa: E731
        if self.config.speculation == "timed":  # one request: its own policy (config.py)
            even = max(even, 0)
            return every(even if all(r.timing.speculate_now() for r in decode) else 0), even
        if self.config.speculation == "always" or self.costs is None:
            return every(max(even, 0)), max(even, 0)
        by_row: list[AcceptanceEstimate | None] = [None] * (max(r.row for r in decode) + 1)
        for request in decode:
            by_row[request.row] = request.acceptance
        # the pass is ragged: the budget caps its queries, a row whose drafts pay may take
        # more than an even share of it (draft_plan.py); priced less often while nothing pays
        chosen = [0]
        self._unpriced += 1
        if self._idle_plans < IDLE_PLANS or self._unpriced >= IDLE_PRICE_EVERY:
            self._unpriced = 0
            chosen = choose_draft_budgets(by_row, self.costs, most, max_queries=budget)
            self._idle_plans = 0 if any(chosen) else self._idle_plans + 1
        if any(chosen):
            self._plain_streak, self._probe_gap = 0, DRAFT_PROBE_EVERY
            self._speculative_steps += 1
            if self._speculative_steps % PLAIN_PROBE_EVERY == 0:
                return every(0), most  # a plain probe keeps c(B, 1) measured
            return {r.request_id: chosen[r.row] for r in decode}, most
        rows = len(decode)
        self._plain_streak += 1
        if even >= 1 and self._plain_streak >= max(self._probe_gap, self._probe_cost_floor(rows)):
            self._plain_streak = 0
            self._probe_gap = min(2 * self._probe_gap, DRAFT_PROBE_MAX_GAP)
            return every(1), most  # a draft probe: see _probe_cost_floor
        return every(0), most

    def _probe_cost_floor(self, rows: int) -> int:
        """The fewest plain steps between two draft probes. A proposer too expensive to draft in
        the shadow (EAGLE-3, a draft model) is only measured when its drafts are verified:
        without probes, an estimate that once said "does not pay" would never be revised, even
        when the text turns predictable (code after prose). A probe verifies one draft token
        per request. Probes back off (32, 64, ... DRAFT_PROBE_MAX_GAP plain steps apart) while
        they find that drafting does not pay, and are never so frequent that the probe's extra
        token costs more than DRAFT_PROBE_SHARE of the time."""
        plain = self.costs.ragged_cost(rows, rows)
        overhead = (self.costs.ragged_cost(rows, 2 * rows) - plain) / plain if plain > 0 else 1.0
        return math.ceil(overhead / DRAFT_PROBE_SHARE)

    # ---- between steps ----------------------------------------------------------------
    def release_done(self) -> list[Request]:
        """Free the rows of requests that need no more steps; pack the pool. Call only when
        no step is in flight."""
        released = [r for r in self.running if r.done]
        if not released:
            return []
        for request in released:
            self.running.remove(request)
            if self.prefix_cache is None or not self.prefix_cache.retain(request):
                self.pool.free(request.row)
            request.row = None
        for owner, source, target in self.pool.compact():
            self.pool.move_row(source, target, max(owner.context_length, owner.prefix_length))
            owner.row = target
        self.pool.apply_pending()
        return released

    def forget_rows(self) -> None:
        """After a failure of the loop: every row free, nothing cached."""
        self.pool.reset()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def drop_cancelled_waiting(self) -> list[Request]:
        """Waiting requests that were cancelled (the engine emits their final output)."""
        dropped, self._dropped = self._dropped, []
        if any(r.cancelled for r in self.waiting):
            dropped += [r for r in self.waiting if r.cancelled]
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
        return dropped
