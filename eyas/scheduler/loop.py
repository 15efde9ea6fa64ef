"""`StepLoop`: one engine step is schedule -> run -> postprocess, and nothing else.

Sequential (EngineConfig.overlap False): the three, one after the other, on the loop thread.

Overlapped: the target runs on the loop thread while a helper thread does the CPU bookkeeping
around it: postprocessing the step before and scheduling the step after.

    loop thread:    | run N ........................ | join | release rows | run N+1 ...
    helper thread:  | postprocess N-1, schedule N+1 |                      | postprocess N, ...

The plan for step N+1 is made before step N's tokens exist: it names requests, not their
roots, context lengths or drafts. Those are the future part of the hand-off: the executor
reads them when N+1 starts, after N wrote them. Requests that finish in step N are still in
plan N+1: the executor skips them (EOS and max_tokens are known at token level), or, for a stop
string found by postprocessing a step late, computes one step that is dropped, never emitted.
KV rows move only between "join" and "run N+1", when the helper is idle.

The target runs on the loop thread (not the helper) on purpose: with OpenMP, a second thread
that runs torch ops makes small ops ~2x slower for both (libgomp stops spin-waiting once more
threads exist than cores; measured on the 2-core CPU). `eyas serve` runs this loop on the
main thread, the thread that loaded the model; `Engine.start()` runs it on a new thread and
first ends the calling thread's idle OpenMP workers (eyas/utils/openmp.py).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from eyas.scheduler.executor import StepExecutor, StepResult
from eyas.scheduler.faults import describe
from eyas.scheduler.output import OutputProcessor
from eyas.scheduler.request import Request, RequestStatus
from eyas.scheduler.scheduler import Scheduler, StepPlan

log = logging.getLogger("eyas.engine")


class StepLoop:
    def __init__(self, scheduler: Scheduler, executor: StepExecutor, outputs: OutputProcessor,
                 overlap: bool, on_finished: Callable[[Request], None]) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.outputs = outputs
        self.on_finished = on_finished  # the engine forgets the request
        self.helper = ThreadPoolExecutor(1, thread_name_prefix="eyas-bookkeeping") if overlap else None
        self.next_plan = StepPlan()  # overlap: made by the helper during the last step
        self.unprocessed: StepResult | None = None  # overlap: the last step's result
        self.released: list[Request] = []  # overlap: released before their last postprocess
        self.steps = 0

    @property
    def busy(self) -> bool:
        """A plan or a result is still to be handled (overlap mode)."""
        return not self.next_plan.empty or self.unprocessed is not None

    def step(self) -> None:
        if self.helper is None:
            self._step_sequential()
        else:
            self._step_overlapped()
        self.steps += 1

    def close(self) -> None:
        if self.helper is not None:
            self.helper.shutdown(wait=True)

    # ---- the two schedules of work ---------------------------------------------------
    def _step_sequential(self) -> None:
        self._drop_cancelled()
        plan = self.scheduler.schedule()
        if not plan.empty:
            result, failed = self._run(plan)
            if result is not None:
                self.outputs.process(result)
            self._fail(failed)
        self._check_finished(self._release())

    def _step_overlapped(self) -> None:
        plan, previous, released = self.next_plan, self.unprocessed, self.released
        job = self.helper.submit(self._bookkeeping, previous, released)
        result, failed = self._run(plan) if not plan.empty else (None, [])  # meanwhile
        self.next_plan = job.result()
        self.unprocessed = result
        self._fail(failed)
        self.released = self._release()  # the helper is idle: rows may move

    def _bookkeeping(self, previous: StepResult | None, released: list[Request]) -> StepPlan:
        if previous is not None:
            self.outputs.process(previous)
        self._check_finished(released)
        self._drop_cancelled()
        return self.scheduler.schedule()

    # ---- pieces ----------------------------------------------------------------------
    def _run(self, plan: StepPlan) -> tuple[StepResult | None, list[Request]]:
        """The step's result and the requests to finish with 'error': those whose own work
        raised (the executor isolates them), or, should the step's shared work fail (a bug,
        an out-of-memory), every request in it."""
        try:
            result = self.executor.run(plan)
            return result, result.failed
        except Exception as error:
            log.exception("step failed; its requests end with finish_reason 'error'")
            failed = plan.decode + [chunk.request for chunk in plan.prefill]
            for request in failed:
                request.fail("step", describe(error))
            return None, failed

    def _fail(self, failed: list[Request]) -> None:
        for request in failed:
            self.finish(request, "error")

    def _drop_cancelled(self) -> None:
        for request in self.scheduler.drop_cancelled_waiting():
            self.finish(request, "abort")

    def _release(self) -> list[Request]:
        released = self.scheduler.release_done()
        for request in released:
            if request.cancelled:
                self.finish(request, "abort")
            self.on_finished(request)
        return released

    def _check_finished(self, released: list[Request]) -> None:
        """Released requests are finished by now (the text level agrees with the token level
        on EOS and max_tokens); a safety net so that no client waits forever."""
        for request in released:
            if request.status != RequestStatus.FINISHED:
                log.warning("%s released unfinished; finishing it", request.request_id)
                self.finish(request, request.sequence.finish_reason or "length")

    def finish(self, request: Request, reason: str) -> None:
        self.outputs.finish(request, reason)
        self.on_finished(request)

    def fail_everything(self, error: Exception) -> None:
        """After a bug in the loop itself: every request ends with 'error'; the loop goes on."""
        requests = list(self.scheduler.waiting) + list(self.scheduler.running)
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self.next_plan, self.unprocessed, self.released = StepPlan(), None, []
        self.scheduler.forget_rows()
        for request in requests:
            request.fail("loop", describe(error))
            request.row = None
            self.finish(request, "error")
