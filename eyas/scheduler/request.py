"""`Request`: one client request inside the engine, and the `RequestOutput` events it emits.

A request carries two views of its output:
- token level (`token_ids`, `context_length`, `root`, `token_done`), written only by the step
  executor: what the next step is built from;
- text level (`sequence`: detokenization, stop strings, text deltas), written only by the
  postprocessing on the engine thread, which may run one step behind (overlap mode).
A stop string is therefore seen one step late at worst: the extra tokens are computed and
dropped (`Sequence.append` takes nothing once finished), never emitted.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import torch

from eyas.engine.logits_process import LogitsProcessor
from eyas.engine.logprobs import TokenLogprob
from eyas.engine.sampling import SamplingParams
from eyas.engine.sequence import Sequence
from eyas.engine.speculative.draft import SpecMetrics
from eyas.engine.speculative.policy import SpeculationPolicy
from eyas.engine.speculative.proposers.base import Proposer
from eyas.scheduler.faults import Failure
from eyas.scheduler.speculation import AcceptanceEstimate, ShadowDraft

_ids = itertools.count()


class RequestStatus(str, Enum):
    WAITING = "waiting"  # queued, no KV row yet
    PREFILLING = "prefilling"  # has a row; prompt chunks being written
    DECODING = "decoding"  # prompt done; one root (+ drafts) per step
    FINISHED = "finished"  # final output emitted; row released (or never held)


@dataclass
class RequestOutput:
    """What a request emits after a step: new text, and the totals once finished."""

    request_id: str
    text: str  # new text since the previous output (stop strings held back until resolved)
    token_ids: list[int]  # new tokens since the previous output
    finished: bool
    finish_reason: str | None  # "stop" (EOS or stop string), "length", "abort" or "error"
    prompt_tokens: int
    completion_tokens: int  # tokens generated so far (an EOS that ended the answer counts)
    speculative: dict[str, Any] | None = None  # acceptance stats, on the final output
    timings: dict[str, float] | None = None  # ttft_s, e2e_s, tpot_s, on the final output
    error: str | None = None  # finish_reason "error": the stage and what failed there
    # With SamplingParams.logprobs: one entry per new token (an EOS that ended the answer
    # included, as completion_tokens counts it). With prompt_logprobs, on the first output:
    # one per prompt token, None for the first (nothing predicts it).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    sequence: Sequence
    on_output: Callable[[RequestOutput], None] | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    proposer: Proposer | None = None
    # Applied to every verification row and to the prompt's last position, before the token
    # is chosen (engine/logits_process.py): penalties, logit_bias, grammar masks.
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    # ---- scheduler state (engine thread) -----------------------------------------------
    status: RequestStatus = RequestStatus.WAITING
    row: int | None = None  # KV cache row while running
    prefill_scheduled: int = 0  # prompt tokens handed to a step (ahead of compute in overlap)
    prefix_length: int = 0  # prompt tokens planned to be reused from the prefix cache
    admitted_order: int = 0
    # ---- token-level state (step executor) ---------------------------------------------
    token_ids: list[int] = field(default_factory=list)  # prompt + emitted tokens (cut at EOS)
    context_length: int = 0  # KV slots holding committed tokens (all but the root)
    root: int | None = None  # last emitted token, not yet in the KV cache
    num_output: int = 0  # tokens emitted at token level
    token_done: bool = False  # EOS or max_new_tokens reached at token level (or failed)
    failure: Failure | None = None  # set when this request's work raised (faults.py)
    prefill_started: bool = False  # its first prefill chunk ran (sampler and proposer set up)
    prefix_hit: int = 0  # prompt tokens whose keys and values were reused (prefix cache)
    generator: torch.Generator | None = None
    noise_base: int | None = None  # Gumbel draws through the screen: their noise (engine/gumbel.py)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    shadow: ShadowDraft = field(default_factory=ShadowDraft)  # unverified draft (plain steps)
    proposed_through: int = 0  # len(token_ids) when the proposer was last asked
    spec_metrics: SpecMetrics = field(default_factory=SpecMetrics)
    timing: SpeculationPolicy | None = None  # speculation "timed": its fallback rule (config.py)
    fallbacks_before: int = 0  # the rule's fallbacks before this request (it spans requests)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token emitted
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # filled by prefill
    # ---- text level and timing (postprocess) -------------------------------------------
    completion_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    cancel_event: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        """The completion at token level (root included; EOS excluded): what processors see."""
        return self.token_ids[len(self.prompt_ids):]

    @property
    def needs_full_logits(self) -> bool:
        """Whether every logit of this request's rows is read (the output layer may not
        screen for the argmax alone, models/output_layer.py)."""
        return bool(self.logits_processors) or self.params.wants_logprobs

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    @property
    def done(self) -> bool:
        """No more steps needed: finished at either level, or cancelled."""
        return (self.token_done or self.sequence.finished or self.cancelled
                or self.status == RequestStatus.FINISHED)

    @property
    def prefill_complete_scheduled(self) -> bool:
        return self.prefill_scheduled >= self.prompt_len

    def fail(self, stage: str, message: str, error: BaseException | None = None) -> None:
        """This request's work raised: no more steps for it (the loop finishes it 'error')."""
        if self.failure is None:
            self.failure = Failure(stage, message, error)
        self.token_done = True

    def append_tokens(self, tokens: list[int], eos_token_ids: set[int]) -> None:
        """Token-level append (executor): stop at EOS or max_new_tokens, as Sequence does."""
        for token in tokens:
            if self.token_done:
                return
            self.num_output += 1
            if token in eos_token_ids:
                self.token_done = True
                return
            self.token_ids.append(token)
            if self.num_output >= self.max_new_tokens:
                self.token_done = True

    def speculative_stats(self, method: str) -> dict[str, Any]:
        """SpecMetrics, the fallbacks of its timed policy and the proposer's own statistics
        (an EAGLE-3 tree's shape, suffix matches, ...)."""
        if self.timing is not None:
            self.spec_metrics.fallbacks = self.timing.fallbacks - self.fallbacks_before
        own = self.proposer.stats() if hasattr(self.proposer, "stats") else {}
        return {"method": method, **self.spec_metrics.as_dict(), **own}
