"""`Engine`: the serving step loop. schedule -> run -> postprocess, and nothing else.

Usage:
    from eyas.scheduler.engine import Engine
    from eyas.scheduler.config import EngineConfig
    engine = Engine(target, EngineConfig(max_running=8), draft="ngram").start()
    result = engine.generate(prompt_ids, SamplingParams(max_tokens=64))    # blocking
    request = engine.submit(prompt_ids, params, on_output=callback)        # streaming
    engine.abort(request.request_id)                                       # client went away
    engine.shutdown()                                                      # drains first

Overlap (EngineConfig.overlap). Off: each step is schedule, run, postprocess, one after the
other on the engine thread. On: the target runs on a worker thread and the engine thread works
one step ahead and one behind:

    engine thread:  schedule N+1 | wait N | release | submit N+1 | postprocess N | schedule N+2
    worker thread:  ....... run N .......           | ........... run N+1 ...........

The plan for step N+1 is made before step N's tokens exist: it names requests, not their
roots, context lengths or drafts. Those are the future part of the hand-off: the worker reads
them when N+1 starts, after N has written them (the worker runs steps in order). Requests that
finish in step N are still in plan N+1; the worker skips them (EOS and max_tokens are known at
token level) or, for a stop string seen a step late, computes one step that is dropped.
KV rows are freed and packed only between "wait N" and "submit N+1", when nothing is in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from eyas.engine.sampling import SamplingParams
from eyas.engine.sequence import GenerationResult, Sequence
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.executor import StepExecutor, StepResult
from eyas.scheduler.kv_pool import KVPool
from eyas.scheduler.output import EngineObserver, OutputProcessor
from eyas.scheduler.proposers import ProposerFactory
from eyas.scheduler.request import Request, RequestOutput, RequestStatus
from eyas.scheduler.scheduler import Scheduler, StepPlan
from eyas.scheduler.speculation import AcceptanceEstimate, StepCostModel

log = logging.getLogger("eyas.engine")


class QueueFull(EyasError):
    """The waiting queue is at `max_waiting` (HTTP 503, retry later)."""


class RequestRejected(EyasError):
    """A request that cannot run: `field` names what is wrong (prompt or max_tokens)."""

    def __init__(self, message: str, field: str, code: str = "context_length_exceeded") -> None:
        super().__init__(message)
        self.field = field
        self.code = code


class Engine:
    def __init__(self, target: Target, config: EngineConfig | None = None, draft: str = "none",
                 observer: EngineObserver | None = None) -> None:
        self.target = target
        self.config = config = config or EngineConfig()
        self.max_model_len = config.resolved_max_model_len(target.config.context_length)
        max_slots = self.max_model_len + config.num_draft_tokens + 1
        self.pool = KVPool(target, config.max_running, max_slots, config.initial_kv_slots)
        self.proposers = ProposerFactory(draft, target, max_slots, config.tree)
        self.costs: StepCostModel | None = None
        if self.proposers.enabled and config.speculation == "auto":
            self.costs = StepCostModel.measure(target, config.batch_sizes_to_profile(),
                                               config.num_draft_tokens + 1)
        pooled = AcceptanceEstimate(forgetting=0.995)  # acceptance over every request so far
        self.scheduler = Scheduler(config, self.pool, self.proposers.enabled, self.costs, pooled)
        self.executor = StepExecutor(target, self.pool, self.proposers.tap_layers, self.costs, pooled)
        self.outputs = OutputProcessor(self.proposers.method, observer)
        self.observer = observer
        self._wakeup = threading.Condition()
        self._incoming: deque[Request] = deque()
        self._requests: dict[str, Request] = {}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="eyas-step") if config.overlap else None
        self._in_flight: tuple[Future, StepPlan] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0

    # ---- client side (any thread) ----------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None,
               request_id: str | None = None) -> Request:
        """Queue a request; raises RequestRejected (does not fit) or QueueFull."""
        self.check_lengths(len(prompt_ids), params.max_tokens)
        sequence = Sequence(prompt_ids, params, self.target.tokenizer, self.target.eos_token_ids,
                            params.max_tokens)
        request = Request(list(prompt_ids), params, params.max_tokens, sequence, on_output,
                          proposer=self.proposers.new())
        if request_id is not None:
            request.request_id = request_id
        with self._wakeup:
            if self._stopping:
                raise QueueFull("the server is shutting down")
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

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 timeout: float | None = None) -> GenerationResult:
        """Submit and wait: the same result type as eyas.engine.generate."""
        return self.generate_many([prompt_ids], params, timeout)[0]

    def generate_many(self, prompts: list[list[int]], params: SamplingParams,
                      timeout: float | None = None) -> list[GenerationResult]:
        """Submit every prompt at once (they batch together) and wait for all."""
        done = [threading.Event() for _ in prompts]
        finals: list[RequestOutput | None] = [None] * len(prompts)
        tokens: list[list[int]] = [[] for _ in prompts]
        texts: list[list[str]] = [[] for _ in prompts]

        def collector(index: int) -> Callable[[RequestOutput], None]:
            def on_output(output: RequestOutput) -> None:
                tokens[index].extend(output.token_ids)
                texts[index].append(output.text)
                if output.finished:
                    finals[index] = output
                    done[index].set()
            return on_output

        for index, prompt in enumerate(prompts):
            self.submit(prompt, params, collector(index))
        results = []
        for index, event in enumerate(done):
            if not event.wait(timeout):
                raise TimeoutError("the engine did not finish in time")
            final = finals[index]
            stats = dict(final.timings or {})
            if final.speculative:
                stats["speculative"] = final.speculative
            results.append(GenerationResult(tokens[index], "".join(texts[index]),
                                            final.finish_reason, final.prompt_tokens, stats))
        return results

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._incoming)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="eyas-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; finish the admitted ones (drain) or abort them; stop."""
        with self._wakeup:
            self._stopping = True
            if not drain:
                for request in self._requests.values():
                    request.cancel_event.set()
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    # ---- the loop (engine thread) ----------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                if not self._iteration():
                    return
            except Exception:  # a bug in the loop itself: fail everything, keep the thread
                log.exception("engine loop failed; failing every request in it")
                self._fail_everything()

    def _iteration(self) -> bool:
        """One pass of the loop; False when the engine has stopped."""
        with self._wakeup:
            while self._incoming:
                self.scheduler.add(self._incoming.popleft())
            idle = not self.scheduler.has_work and self._in_flight is None
            if idle and self._stopping:
                return False
            if idle:
                self._wakeup.wait(0.05)
                return True
        for request in self.scheduler.drop_cancelled_waiting():
            self._finish(request, "abort")
        if self._worker is None:
            self._step()
        else:
            self._step_overlapped()
        self.steps += 1
        if self.observer is not None:
            self.observer.queue_changed(self.num_running, self.num_waiting)
        return True

    def _fail_everything(self) -> None:
        if self._in_flight is not None:
            try:
                self._in_flight[0].result()
            except Exception:
                pass
            self._in_flight = None
        requests = list(self.scheduler.waiting) + list(self.scheduler.running)
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        for row in range(self.pool.rows):
            self.pool.free(row)
        for request in requests:
            request.token_done = True
            request.row = None
            self._finish(request, "error")

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        if not plan.empty:
            result = self._run(plan)
            if result is not None:
                self.outputs.process(result)
        self._finish_released(self._release())

    def _step_overlapped(self) -> None:
        plan = self.scheduler.schedule()  # while the step in flight computes
        result = None
        if self._in_flight is not None:
            future, running_plan = self._in_flight
            self._in_flight = None
            result = self._run(running_plan, future)
        released = self._release()  # nothing in flight: rows may move
        if not plan.empty:
            self._in_flight = (self._worker.submit(self.executor.run, plan), plan)
        if result is not None:
            self.outputs.process(result)  # while the step just submitted computes
        self._finish_released(released)
        if plan.empty and self._in_flight is None and result is None:
            time.sleep(0.001)  # requests are all cancelled/finished: let the loop settle

    def _run(self, plan: StepPlan, future: Future | None = None) -> StepResult | None:
        try:
            return future.result() if future is not None else self.executor.run(plan)
        except Exception:  # a bug or an out-of-memory: fail this step's requests, keep serving
            log.exception("step failed; its requests end with finish_reason 'error'")
            for request in plan.decode + [chunk.request for chunk in plan.prefill]:
                request.token_done = True
                self.outputs.finish(request, "error")
            return None

    def _release(self) -> list[Request]:
        released = self.scheduler.release_done()
        with self._wakeup:
            for request in released:
                self._requests.pop(request.request_id, None)
        for request in released:
            if request.cancelled:
                self._finish(request, "abort")
        return released

    def _finish_released(self, released: list[Request]) -> None:
        """Released requests are finished by now (the text level agrees with the token level
        on EOS and max_tokens); this is a safety net so that no client waits forever."""
        for request in released:
            if request.status != RequestStatus.FINISHED:
                log.warning("%s released unfinished; finishing it", request.request_id)
                self._finish(request, request.sequence.finish_reason or "length")

    def _finish(self, request: Request, reason: str) -> None:
        self.outputs.finish(request, reason)
        with self._wakeup:
            self._requests.pop(request.request_id, None)
