"""`Engine`: the serving engine's front: submit, abort, generate, and the loop's lifecycle.

Usage:
    from eyas.scheduler.engine import Engine
    from eyas.scheduler.config import EngineConfig
    engine = Engine(target, EngineConfig(max_running=8), draft="ngram").start()  # loop thread
    result = engine.generate(prompt_ids, SamplingParams(max_tokens=64))    # blocking
    request = engine.submit(prompt_ids, params, on_output=callback)        # streaming
    engine.abort(request.request_id)                                       # client went away
    engine.abort_all()                                                     # drain timed out
    engine.shutdown()                                                      # drains first

    engine.run()   # instead of start(): the loop on this thread (eyas serve: the main thread,
                   # which loaded the model; see loop.py for why that is faster)

One request decoded on the caller's thread (`eyas generate`, `eval`, `bench offline`) is the
same engine with one row: eyas.scheduler.single.generate_one.

Once the loop runs on its own thread, run no torch work on the thread that started it:
start() ends that thread's idle OpenMP workers, and new ones beside the loop's would make
every decode step 2-3x slower on a small CPU (utils/openmp.py).

Requests are queued here from any thread; the loop (loop.py) takes them between steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Iterable

import torch

from eyas.engine.logits_process import LogitsProcessor
from eyas.engine.penalties import sampling_processors
from eyas.engine.sampling import SamplingParams
from eyas.engine.sequence import GenerationResult, Sequence
from eyas.engine.speculative.policy import policy_for
from eyas.engine.speculative.proposers.base import Proposer
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.executor import StepExecutor
from eyas.scheduler.kv_pool import KVPool
from eyas.scheduler.loop import StepLoop
from eyas.scheduler.output import EngineObserver, OutputProcessor, generation_result
from eyas.scheduler.prefix_cache import PrefixCache
from eyas.scheduler.proposers import ProposerFactory
from eyas.scheduler.request import Request, RequestOutput, RequestStatus
from eyas.scheduler.scheduler import Scheduler
from eyas.scheduler.speculation import AcceptanceEstimate, StepCostModel
from eyas.utils.openmp import release_thread_pool

log = logging.getLogger("eyas.engine")


class QueueFull(EyasError):
    """The waiting queue is at `max_waiting`, or the engine is shutting down (HTTP 503, retry
    later); `reason` is queue_full or shutting_down."""

    def __init__(self, message: str, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.reason = reason


class RequestRejected(EyasError):
    """A request that cannot run: `field` names what is wrong (prompt or max_tokens)."""

    def __init__(self, message: str, field: str, code: str = "context_length_exceeded") -> None:
        super().__init__(message)
        self.field = field
        self.code = code


class Engine:
    def __init__(self, target: Target, config: EngineConfig | None = None,
                 draft: str | Proposer = "none", observer: EngineObserver | None = None) -> None:
        """draft: a --draft spec (every request gets its own copy of the proposer it builds),
        or a proposer object, served as it is (one request at a time: speculation 'timed')."""
        self.target = target
        self.config = config = config or EngineConfig()
        self.max_model_len = config.resolved_max_model_len(target.config.context_length)
        max_slots = self.max_model_len + config.num_draft_tokens + 1
        self.pool = KVPool(target, config.max_running, max_slots, config.initial_kv_slots)
        self.proposers = ProposerFactory(draft, target, max_slots, config.tree)
        self.prefix_cache = PrefixCache(self.pool) if config.prefix_caching else None
        self.pool.keep_taps = config.prefix_caching and bool(self.proposers.tap_layers)
        self.costs: StepCostModel | None = None
        if self.proposers.enabled and config.speculation == "auto":
            self.costs = StepCostModel.measure(target, config.batch_sizes_to_profile(),
                                               config.num_draft_tokens + 1)
        elif config.prefill_stretch is not None and config.max_running > 1:
            # prefill priced against the decode pass (scheduler.py): one and two queries a
            # row give the pass's fixed part and its price per query
            self.costs = StepCostModel.measure(target, config.batch_sizes_to_profile(), 2)
        pooled = AcceptanceEstimate(forgetting=0.995)  # acceptance over every request so far
        if self.costs is not None and self.proposers.enabled:  # the proposer's measured cost, not "free"
            pooled.draft_seconds_per_token = self.proposers.draft_seconds_per_token(target)
        self.scheduler = Scheduler(config, self.pool, self.proposers.enabled, self.costs, pooled,
                                   self.prefix_cache)
        self.executor = StepExecutor(target, self.pool, self.proposers.tap_layers, self.costs, pooled,
                                     prefix_caching=config.prefix_caching,
                                     single_stream=config.speculation == "timed")
        self.faults = self.executor.faults  # per-request fault injection for tests (faults.py)
        self.outputs = OutputProcessor(self.proposers.method, observer, self.faults)
        self.observer = observer
        self._wakeup = threading.Condition()
        self._incoming: deque[Request] = deque()
        self._requests: dict[str, Request] = {}
        self.loop = StepLoop(self.scheduler, self.executor, self.outputs, config.overlap,
                             self._forget)
        self._thread: threading.Thread | None = None
        self._running = threading.Event()  # the loop is running (on some thread)
        self._exited = threading.Event()  # the loop has returned
        self._stopping = False
        self._reported: tuple[int, ...] = ()  # the state the observer last saw (_report_state)
        self._reported_at = 0.0
        if observer is not None:
            observer.kv_changed(0, self.pool.rows, self.pool.slots, self.kv_cache_bytes)

    # ---- client side (any thread) ----------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None,
               request_id: str | None = None,
               logits_processors: Iterable[LogitsProcessor] = ()) -> Request:
        """Queue a request; raises RequestRejected (does not fit) or QueueFull.
        logits_processors: applied at every position before a token is chosen, drafts
        included (engine/logits_process.py), after those `params` ask for (logit_bias and
        penalties, engine/penalties.py)."""
        self.check_lengths(len(prompt_ids), params.max_tokens)
        sequence = Sequence(prompt_ids, params, self.target.tokenizer, self.target.eos_token_ids,
                            params.max_tokens)
        request = Request(list(prompt_ids), params, params.max_tokens, sequence, on_output,
                          proposer=self.proposers.new(),
                          logits_processors=sampling_processors(params, prompt_ids) + list(logits_processors))
        if request_id is not None:
            request.request_id = request_id
        if self.config.speculation == "timed":
            request.timing = policy_for(request.proposer, self.config.policy)
            request.timing.begin_request()
            request.fallbacks_before = request.timing.fallbacks
        with self._wakeup:
            if self._stopping:
                raise QueueFull("the server is shutting down", "shutting_down")
            if len(self._incoming) + len(self.scheduler.waiting) >= self.config.max_waiting:
                raise QueueFull(f"the queue is full ({self.config.max_waiting} waiting requests)")
            self._incoming.append(request)
            self._requests[request.request_id] = request
            self._wakeup.notify()
        return request

    def check_lengths(self, prompt_len: int, max_tokens: int) -> None:
        limit = self.max_model_len
        if prompt_len == 0:
            raise RequestRejected("the prompt is empty", "prompt", "invalid_value")
        if prompt_len >= limit:
            raise RequestRejected(f"the prompt has {prompt_len} tokens; this server's context is "
                                  f"{limit} tokens (prompt + output must fit)", "prompt")
        if prompt_len + max_tokens > limit:
            raise RequestRejected(f"max_tokens {max_tokens} plus the prompt's {prompt_len} tokens "
                                  f"exceed this server's context of {limit} tokens; ask for at "
                                  f"most {limit - prompt_len}", "max_tokens")

    def abort(self, request_id: str) -> None:
        """Cancel a request (e.g. its client disconnected); its final output says 'abort'."""
        with self._wakeup:
            request = self._requests.get(request_id)
            if request is not None:
                request.cancel_event.set()
                self._wakeup.notify()

    def abort_all(self) -> int:
        """Cancel every admitted request (a drain that ran out of time); each ends with a
        final output saying 'abort'. Returns how many were cancelled."""
        with self._wakeup:
            for request in self._requests.values():
                request.cancel_event.set()
            self._wakeup.notify()
            return len(self._requests)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 timeout: float | None = None) -> GenerationResult:
        """Submit and wait: the same result type as eyas.engine.generate."""
        return self.generate_many([prompt_ids], params, timeout)[0]

    def generate_many(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                      timeout: float | None = None,
                      logits_processors: Iterable[LogitsProcessor] | list[list[LogitsProcessor]] = ()
                      ) -> list[GenerationResult]:
        """Submit every prompt at once (they batch together) and wait for all; `params` is one
        SamplingParams for every prompt or one per prompt (e.g. a seed each); likewise
        `logits_processors`: one list for every prompt, or a list of lists, one per prompt
        (a grammar constraint holds per-request state: one each)."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        processors = list(logits_processors)
        per_prompt = (processors if processors and all(isinstance(p, (list, tuple)) for p in processors)
                      else [processors] * len(prompts))
        if len(each) != len(prompts) or len(per_prompt) != len(prompts):
            raise ValueError(f"{len(each)} sampling parameters and {len(per_prompt)} processor "
                             f"lists for {len(prompts)} prompts")
        done = [threading.Event() for _ in prompts]
        outputs: list[list[RequestOutput]] = [[] for _ in prompts]

        def collector(index: int) -> Callable[[RequestOutput], None]:
            def on_output(output: RequestOutput) -> None:
                outputs[index].append(output)
                if output.finished:
                    done[index].set()
            return on_output

        requests = [self.submit(prompt, request_params, collector(index),
                                logits_processors=per_prompt[index])
                    for index, (prompt, request_params) in enumerate(zip(prompts, each))]
        results = []
        for request, event, collected in zip(requests, done, outputs):
            if not event.wait(timeout):
                raise TimeoutError("the engine did not finish in time")
            results.append(generation_result(request, collected))
        return results

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._incoming)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV pool as allocated now (it grows on demand and is kept)."""
        return self.pool.bytes_per_slot() * self.pool.slots

    @property
    def alive(self) -> bool:
        return self._running.is_set()

    @property
    def steps(self) -> int:
        return self.loop.steps

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> Engine:
        """Run the loop on a new daemon thread. The calling thread's idle OpenMP workers end
        first (utils/openmp.py): with a second pool beside the loop's, every decode step on
        a small CPU took 2.5-3x as long."""
        release_thread_pool()
        self._thread = threading.Thread(target=self.run, name="eyas-engine", daemon=True)
        self._thread.start()
        self._running.wait(10)
        return self

    def run(self, stop_when: Callable[[], bool] | None = None) -> None:
        """Run the loop on this thread until shutdown(), or, once idle, until stop_when()."""
        self._exited.clear()
        self._running.set()
        try:
            with torch.inference_mode():  # once, not once a step (StepExecutor.run)
                self._loop(stop_when)
        finally:
            self._running.clear()
            self._exited.set()

    def _loop(self, stop_when: Callable[[], bool] | None) -> None:
        while True:
            with self._wakeup:
                while self._incoming:
                    self.scheduler.add(self._incoming.popleft())
                idle = not self.scheduler.has_work and not self.loop.busy
                if idle and (self._stopping or (stop_when is not None and stop_when())):
                    return
                if idle:
                    self._wakeup.wait(0.05)
                    continue
            try:
                self.loop.step()
            except Exception as error:  # a bug in the loop itself: fail everything, keep serving
                log.exception("engine loop failed; failing every request in it")
                self.loop.fail_everything(error)
            if self.observer is not None:
                self._report_state()

    def _report_state(self, every_s: float = 0.5) -> None:
        """The queue, KV pool and prefix cache to the observer's gauges: when any of them
        changed, and every `every_s` seconds. (Every step, this cost a one-token step ~1% of
        its time behind the server.)"""
        cache = self.prefix_cache
        running, waiting, free, slots = self.num_running, self.num_waiting, self.pool.num_free, self.pool.slots
        state = (running, waiting, free, slots,
                 cache.queries if cache is not None else 0, cache.evictions if cache is not None else 0)
        now = time.monotonic()
        if state == self._reported and now - self._reported_at < every_s:
            return
        self._reported, self._reported_at = state, now
        self.observer.queue_changed(running, waiting)
        self.observer.kv_changed(self.pool.rows - free, self.pool.rows, slots, self.kv_cache_bytes)
        if cache is not None and hasattr(self.observer, "prefix_cache_changed"):
            self.observer.prefix_cache_changed(cache.stats())

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; finish the admitted ones (drain) or abort them; wait for the
        loop to return (whichever thread runs it)."""
        with self._wakeup:
            self._stopping = True
            if not drain:
                for request in self._requests.values():
                    request.cancel_event.set()
            self._wakeup.notify()
        if self._running.is_set():
            self._exited.wait(timeout)
        if self._thread is not None:
            self._thread.join(timeout)
        self.loop.close()

    def _forget(self, request: Request) -> None:
        finish = getattr(request.proposer, "finish", None)
        if finish is not None:  # suffix decoding: the output joins the global store (once)
            finish()
        if request.status == RequestStatus.FINISHED and request.row is None:
            # final output out and its row released (a request failed mid-step is forgotten
            # again at release): the proposer's own state (a draft model's KV cache, tens of
            # MB for a long request) goes now, whoever still holds the request
            request.proposer = request.acceptance.tree = None
        with self._wakeup:
            self._requests.pop(request.request_id, None)
