"""`EngineConfig`: the serving engine's limits, checked once when it is built.

Usage:
    config = EngineConfig(max_running=16, max_step_tokens=512, num_draft_tokens=4)
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.engine.speculative.policy import PolicyConfig
from eyas.errors import EyasError

SPECULATION_MODES = ("auto", "always", "never", "timed")


@dataclass
class EngineConfig:
    max_running: int = 16  # KV cache rows: requests decoded together
    max_waiting: int = 256  # queued requests beyond which new ones are refused (HTTP 503)
    max_model_len: int | None = None  # prompt + output per request; None = min(context, 4096)
    max_step_tokens: int = 512  # tokens in one step: decode rows x (1 + drafts) + prefill chunks
    prefill_chunk: int = 256  # most prompt tokens of one request prefilled per step
    # while requests decode, the prompt tokens of a step are priced with the measured cost
    # model so that the step takes at most this multiple of its plain decode pass (a lower
    # TPOT for the decoding requests, a later first token for the joining ones; at least
    # MIN_PREFILL_TOKENS a step, so every prompt progresses); None (the default: a stretch of 3
    # measured 0.89-0.91x the throughput with no lower median TPOT, docs/serving.md): prefill
    # fills the token budget (max_step_tokens), up to prefill_chunk per request
    prefill_stretch: float | None = None
    num_draft_tokens: int = 4  # most draft tokens per request per step
    # auto: k per step from measured costs (speculation.py) | always | never | timed: one
    # request at a time (max_running 1, what `eyas generate`, `eval` and `bench offline` run):
    # its proposer sizes its own drafts (`single_stream`) and `policy` falls back to plain
    # steps while timed speculative steps are slower per token (engine/speculative/policy.py)
    speculation: str = "auto"
    policy: PolicyConfig | None = None  # timed: the fallback rule (None: PolicyConfig())
    tree: str | None = None  # EAGLE-3 tree shape: auto, chain:K or DEPTH,TOPK,TOTAL
    overlap: bool = False  # schedule N+1 and postprocess N-1 while step N computes (loop.py)
    prefix_caching: bool = True  # reuse the KV rows of earlier requests' prefixes (prefix_cache.py)
    initial_kv_slots: int = 256  # KV slots per row at start; doubled when a row needs more
    profile_batch_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to max_running

    def __post_init__(self) -> None:
        positive = {"max_running": self.max_running, "max_step_tokens": self.max_step_tokens,
                    "prefill_chunk": self.prefill_chunk, "num_draft_tokens": self.num_draft_tokens,
                    "initial_kv_slots": self.initial_kv_slots}
        for name, value in positive.items():
            if value < 1:
                raise EyasError(f"{name} must be >= 1, got {value}")
        if self.prefill_stretch is not None and not self.prefill_stretch > 1.0:
            raise EyasError(f"prefill_stretch must be > 1 (a multiple of the decode pass) or None, "
                            f"got {self.prefill_stretch}")
        if self.max_waiting < 0:
            raise EyasError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise EyasError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_step_tokens < self.max_running:
            raise EyasError(f"max_step_tokens ({self.max_step_tokens}) must be >= max_running "
                            f"({self.max_running}): every running request decodes each step")
        if self.speculation not in SPECULATION_MODES:
            raise EyasError(f"unknown speculation mode '{self.speculation}'; accepted: "
                            f"{', '.join(SPECULATION_MODES)}")
        if self.speculation == "timed" and self.max_running != 1:
            raise EyasError(f"speculation 'timed' decodes one request at a time (max_running 1), "
                            f"got max_running {self.max_running}")

    def resolved_max_model_len(self, context_length: int) -> int:
        if self.max_model_len is None:
            return min(context_length, 4096)
        if self.max_model_len > context_length:
            raise EyasError(f"max_model_len {self.max_model_len} exceeds the model's context "
                            f"({context_length} tokens)")
        return self.max_model_len

    def batch_sizes_to_profile(self) -> list[int]:
        if self.profile_batch_sizes:
            return sorted({b for b in self.profile_batch_sizes if 1 <= b <= self.max_running})
        sizes, size = [], 1
        while size < self.max_running:
            sizes.append(size)
            size *= 2
        return sizes + [self.max_running]
