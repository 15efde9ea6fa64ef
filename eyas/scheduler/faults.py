"""Per-request fault isolation: the stages of a step, what a failure records, and a hook
that injects faults for tests.

Each request's share of a step runs inside one of these stages; an exception raised there
ends that request alone (finish_reason "error", a 500 or a stream error event in the server,
`eyas:request_failures_total{stage}` on /metrics) and every other request of the batch goes
on as if it had been alone:

| stage      | a request's work                                                        |
|------------|-------------------------------------------------------------------------|
| prefill    | its sampler and proposer set-up, a prompt chunk's pass                  |
| draft      | its proposer drafting under the root, or reading the step's pass        |
| verify     | checking its draft against the target's logits, compacting its KV row;  |
|            | its row of the batched pass (redone alone when the shared pass fails)   |
| sample     | drawing its next token(s) from the target's distribution                |
| detokenize | text deltas and stop strings (postprocessing)                           |

Two more labels count failures that are not one request's: "step" (a step's shared work
failed: every request in it ends) and "loop" (the loop itself failed).

Usage (tests):
    engine.faults.inject("sample", request_id="req-7")            # one request, one stage
    engine.faults.inject("draft", when=lambda r: r.params.max_tokens == 13)
    engine.faults.clear()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from eyas.scheduler.request import Request

STAGES = ("prefill", "draft", "verify", "sample", "detokenize")
FAILURE_LABELS = STAGES + ("step", "loop")


class InjectedFault(RuntimeError):
    """Raised by FaultInjector.check for a request and stage chosen by a test."""


@dataclass
class Failure:
    """Why a request ended with finish_reason 'error'."""

    stage: str  # one of FAILURE_LABELS
    message: str  # "<ExceptionType>: <text>", shown to the client
    error: BaseException | None = None  # what was raised (single-stream callers re-raise it)


@dataclass
class FaultInjector:
    """Rules (stage, predicate on the request); `check` raises where one matches."""

    rules: list[tuple[str, Callable[[Request], bool]]] = field(default_factory=list)

    def inject(self, stage: str, request_id: str | None = None,
               when: Callable[[Request], bool] | None = None) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage '{stage}'; accepted: {', '.join(STAGES)}")
        if (request_id is None) == (when is None):
            raise ValueError("give exactly one of request_id and when")
        predicate = when if when is not None else (lambda request: request.request_id == request_id)
        self.rules.append((stage, predicate))

    def clear(self) -> None:
        self.rules.clear()

    def check(self, request: Request, stage: str) -> None:
        for rule_stage, predicate in self.rules:
            if rule_stage == stage and predicate(request):
                raise InjectedFault(f"injected fault at {stage} for {request.request_id}")


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:300]
