"""Postprocessing on the engine thread: tokens -> text deltas, stop strings, finishing.

`OutputProcessor.process` feeds each request's new tokens to its `Sequence` (which cuts at EOS,
a stop string or max_tokens exactly where plain decoding would), and hands a `RequestOutput` to
the request's callback. `finish` emits the final output once, with usage, timings and the
request's speculative statistics, and tells the observer (the server's metrics).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from eyas.engine.sequence import GenerationResult
from eyas.scheduler.executor import StepResult, StepStats
from eyas.scheduler.faults import FaultInjector, InjectedFault, describe
from eyas.scheduler.request import Request, RequestOutput, RequestStatus

log = logging.getLogger("eyas.engine")


class EngineObserver(Protocol):
    """What the engine reports (the server's Prometheus metrics implement it)."""

    def step_finished(self, stats: StepStats) -> None: ...

    def request_finished(self, request: Request) -> None: ...

    def queue_changed(self, running: int, waiting: int) -> None: ...

    def kv_changed(self, rows_in_use: int, rows: int, slots: int, cache_bytes: int) -> None: ...


class OutputProcessor:
    def __init__(self, method: str, observer: EngineObserver | None = None,
                 faults: FaultInjector | None = None) -> None:
        self.method = method  # drafting method name, for the per-response stats
        self.observer = observer
        self.faults = faults or FaultInjector()

    def process(self, result: StepResult) -> None:
        now = time.perf_counter()
        for request, tokens in result.emitted:
            if request.status == RequestStatus.FINISHED:
                continue  # finished earlier (stop string seen a step late, or cancelled)
            sequence = request.sequence
            known = len(sequence.output_ids)
            before = request.completion_tokens
            try:  # the "detokenize" stage (faults.py): a failure here ends this request alone
                self.faults.check(request, "detokenize")
                taken = sequence.append(tokens)
                text, new_ids = sequence.take_new_text(), sequence.output_ids[known:]
            except Exception as error:
                self._failed(request, error)
                continue
            request.completion_tokens += taken
            if request.first_token_time is None and taken:
                request.first_token_time = now
            logprobs = logprobs_of(request, before, taken)
            if sequence.finished:
                self.finish(request, sequence.finish_reason, text, new_ids, logprobs)
            elif text or new_ids:
                self._emit(request, RequestOutput(
                    request.request_id, text, new_ids, False, None, request.prompt_len,
                    request.completion_tokens, **logprobs))
        if self.observer is not None:
            self.observer.step_finished(result.stats)

    def finish(self, request: Request, reason: str, text: str = "",
               token_ids: list[int] | None = None, logprobs: dict[str, Any] | None = None) -> None:
        if request.status == RequestStatus.FINISHED:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.perf_counter()
        if reason == "abort":
            text = text or request.sequence.take_new_text()
        speculative = request.speculative_stats(self.method) if request.proposer is not None else None
        failure = request.failure
        error = f"{failure.stage}: {failure.message}" if failure is not None else None
        if reason == "error" and error is None:
            error = "unknown"
        self._emit(request, RequestOutput(
            request.request_id, text, list(token_ids or []), True, reason, request.prompt_len,
            request.completion_tokens, speculative, timings(request), error, **(logprobs or {})))
        if self.observer is not None:
            self.observer.request_finished(request)

    def _failed(self, request: Request, error: Exception) -> None:
        if isinstance(error, InjectedFault):
            log.error("%s failed at detokenize: %s", request.request_id, error)
        else:
            log.exception("%s failed at detokenize; it alone ends", request.request_id)
        request.fail("detokenize", describe(error))
        self.finish(request, "error")

    @staticmethod
    def _emit(request: Request, output: RequestOutput) -> None:
        if request.on_output is None:
            return
        try:
            request.on_output(output)
        except Exception:  # a broken consumer must not stop the engine
            log.exception("output callback of %s failed", request.request_id)


def timings(request: Request) -> dict[str, float]:
    end = request.finish_time or time.perf_counter()
    first = request.first_token_time
    result = {"e2e_s": end - request.arrival_time}
    if first is not None:
        result["ttft_s"] = first - request.arrival_time
        if request.completion_tokens > 1:
            result["tpot_s"] = (end - first) / (request.completion_tokens - 1)
    return result


def logprobs_of(request: Request, before: int, taken: int) -> dict[str, Any]:
    """RequestOutput fields for the `taken` tokens after the first `before` of the completion:
    their logprobs (the executor's entries, one per emitted token, in order), and the
    prompt's with the first output."""
    fields: dict[str, Any] = {}
    if request.params.logprobs is not None:
        fields["logprobs"] = request.output_logprobs[before : before + taken]
    if request.params.prompt_logprobs is not None and before == 0 and taken:
        fields["prompt_logprobs"] = list(request.prompt_logprobs)
    return fields


def generation_result(request: Request, outputs: list[RequestOutput]) -> GenerationResult:
    """The GenerationResult of a finished request: tokens and text from its outputs, timings
    (ttft_s from submission, decode_s and tokens_per_s after the first token) and, with a
    proposer, its speculative statistics."""
    tokens = [token for output in outputs for token in output.token_ids]
    final = outputs[-1]
    first, done = request.first_token_time, request.finish_time
    decode_seconds = max(done - first, 1e-9) if first is not None else 0.0
    stats = {
        **(final.timings or {}),
        "ttft_s": first - request.arrival_time if first is not None else 0.0,
        "decode_s": decode_seconds,
        "tokens_per_s": max(len(tokens) - 1, 0) / decode_seconds if decode_seconds else 0.0,
    }
    if final.speculative:
        stats["speculative"] = final.speculative
    logprobs = ([entry for output in outputs for entry in (output.logprobs or [])]
                if request.params.logprobs is not None else None)
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    return GenerationResult(tokens, "".join(output.text for output in outputs), final.finish_reason,
                            final.prompt_tokens, stats, logprobs, prompt_logprobs)
