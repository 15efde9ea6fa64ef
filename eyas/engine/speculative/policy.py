"""Never slower by design: switch speculation off for a while when it does not pay.

Single-stream decoding (the engine with one request, speculation "timed": scheduler/config.py)
reports each step's wall time and emitted tokens. Plain steps measure the
plain time per token; after every `window` speculative steps the speculative time per token is
compared with it. Speculation that is slower falls back to plain decoding for `backoff` tokens
(doubling, up to `max_backoff`, each time it fails again), then is tried again: acceptance
changes along a response (code being copied, then prose).

The requests one proposer drafts for, one after another (a benchmark's prompts, an eval set),
are one stream to the policy (`policy_for`): a method that did not pay on the last request
starts the next one in plain decoding with its backoff carried over, instead of paying the
warm-up and judgement windows again on every prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from weakref import WeakKeyDictionary

from eyas.errors import EyasError


@dataclass
class PolicyConfig:
    enabled: bool = True
    warmup_plain_steps: int = 3  # plain steps that measure plain speed first
    window: int = 6  # speculative steps per judgement
    backoff: int = 16  # plain tokens after a failed window
    max_backoff: int = 256
    margin: float = 1.0  # speculation must be at least this many times faster than plain

    def __post_init__(self) -> None:
        if self.window < 1 or self.backoff < 1 or self.margin <= 0:
            raise EyasError("policy window, backoff and margin must be positive")


class SpeculationPolicy:
    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.plain_seconds_per_token: float | None = None
        self.plain_left = self.config.warmup_plain_steps if self.config.enabled else 0
        self.current_backoff = self.config.backoff
        self.window_seconds = 0.0
        self.window_tokens = 0
        self.window_steps = 0
        self.fallbacks = 0

    def speculate_now(self) -> bool:
        return self.plain_left <= 0

    def record_plain(self, seconds: float) -> None:
        previous = self.plain_seconds_per_token
        self.plain_seconds_per_token = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        self.plain_left -= 1

    def record_speculative(self, seconds: float, emitted: int) -> None:
        if not self.config.enabled:
            return
        self.window_seconds += seconds
        self.window_tokens += emitted
        self.window_steps += 1
        if self.window_steps < self.config.window or self.plain_seconds_per_token is None:
            return
        speculative = self.window_seconds / max(self.window_tokens, 1)
        if speculative * self.config.margin > self.plain_seconds_per_token:
            self.plain_left = self.current_backoff
            self.current_backoff = min(self.current_backoff * 2, self.config.max_backoff)
            self.fallbacks += 1
        else:
            self.current_backoff = self.config.backoff
        self.window_seconds, self.window_tokens, self.window_steps = 0.0, 0, 0


_SHARED: WeakKeyDictionary[object, SpeculationPolicy] = WeakKeyDictionary()


def policy_for(proposer: object, config: PolicyConfig | None) -> SpeculationPolicy:
    """The fallback rule of the requests `proposer` drafts for (one stream: see the module
    docstring). A proposer that cannot be weakly referenced, or a changed config, starts a new
    policy."""
    config = config or PolicyConfig()
    try:
        policy = _SHARED.get(proposer)
    except TypeError:
        return SpeculationPolicy(config)
    if policy is None or policy.config != config:
        policy = _SHARED[proposer] = SpeculationPolicy(config)
    return policy
