"""Never slower by design: switch speculation off for a while when it does not pay.

Single-stream decoding (the engine with one request, speculation "timed": scheduler/config.py)
reports each step's wall time and emitted tokens. Plain steps measure the
plain time per token; after every `window` speculative steps the speculative time per token is
compared with it. Speculation that is slower falls back to plain decoding for `backoff` tokens
(doubling, up to `max_backoff`, each time it fails again), then is tried again: acceptance
changes along a response (code being copied, then prose).

Both times are robust to the load spikes of a shared machine: the plain time is the median of
the last `plain_samples` plain steps, and a window's time per token is its seconds over its
tokens without an outlier step (one over `OUTLIER` times the window's median step, with its
tokens). A window against a running mean of plain steps was swayed by one slow step either
way: a plain step slowed by a neighbour's burst let a losing window pass, one slowed draft step
failed a window that paid. (A window's median step would not do: a window's steps differ by
tree size, and the steps of the big trees are the ones that emit the most tokens.)

A window's tokens are its noisy part. Its steps take about the same time each, but the tokens
they emit vary by step: with one draft a step accepted 55% of the time, a window of 6 steps
emits 6-12 tokens, and a quarter of such windows accept 2 drafts or fewer. Judged on its own
tokens, a method that ran 1.10x plain over 16 prompts fell back 25 times and ran at 1.04x (one
draft a step, SmolLM2 on a 2-core Xeon). So a window is priced at its mean step over the mean
tokens a step of the last `history` speculative steps of the request (the window's among
them): the step time follows the machine at once, acceptance over up to ~8 windows. Acceptance
changes from one request to the next (a question asked again is drafted whole by suffix
decoding, a new one hardly), so a request's history starts empty (`begin_request`).

The plain time a window is judged against may be old: a proposer that pays drafts every step,
so the plain speed is the one measured before speculation began, while the context grew and
the machine's load changed. A window judged slower against a plain time measured more than
`stale_after` steps before is not a fallback yet: `refresh_steps` plain steps measure the plain
speed again, and the window is judged against them (a busy moment had cost a speculating
request `backoff` plain tokens, a quarter of a 64-token answer, although it paid).

The requests one proposer drafts for, one after another (a benchmark's prompts, an eval set),
are one stream to the policy (`policy_for`): a method that does not pay on the stream starts
the next request in plain decoding with its backoff carried over, instead of paying the
warm-up and judgement windows again on every prompt. Whether it pays is the stream's evidence,
not the last request's: the speculative steps of its last `stream_steps` (their seconds over
their tokens, against the plain time). Where the stream pays, a new request starts drafting
with the backoff reset: one question of low acceptance had left the next ones in plain decoding
for up to `max_backoff` tokens (the shipped SmolLM2 head on MT-Bench, 16 x 128, Zen 4: after
the first prompt's fallbacks, the next two prompts decoded 118 and 51 steps plain, although
their drafted steps cost 4.4 and 3.6 ms a token against 5.1 plain).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from eyas.errors import EyasError

OUTLIER = 2.0  # a window step this many times its window's median step is left out


@dataclass
class PolicyConfig:
    enabled: bool = True
    warmup_plain_steps: int = 3  # plain steps that measure plain speed first
    window: int = 6  # speculative steps per judgement
    backoff: int = 16  # plain tokens after a failed window
    max_backoff: int = 256
    margin: float = 1.0  # speculation must be at least this many times faster than plain
    stale_after: int = 12  # steps after which a plain time is measured again before a fallback
    refresh_steps: int = 2  # plain steps that measure it again
    plain_samples: int = 16  # the plain time is the median of this many recent plain steps
    history: int = 48  # a window's tokens a step: the mean over this many recent speculative steps
    stream_steps: int = 192  # the stream's recent speculative steps that decide how a request starts

    def __post_init__(self) -> None:
        if self.window < 1 or self.backoff < 1 or self.margin <= 0:
            raise EyasError("policy window, backoff and margin must be positive")
        if self.stale_after < 1 or self.refresh_steps < 1 or self.plain_samples < 1:
            raise EyasError("policy stale_after, refresh_steps and plain_samples must be positive")
        if self.history < self.window:
            raise EyasError(f"policy history ({self.history}) must be at least its window ({self.window})")
        if self.stream_steps < 2 * self.window:
            raise EyasError(f"policy stream_steps ({self.stream_steps}) must be at least two windows "
                            f"({2 * self.window})")


class SpeculationPolicy:
    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.plain_steps: deque[float] = deque(maxlen=self.config.plain_samples)  # seconds each
        self.plain_left = self.config.warmup_plain_steps if self.config.enabled else 0
        self.current_backoff = self.config.backoff
        self.window_seconds: list[float] = []  # each speculative step of the window
        self.window_tokens: list[int] = []  # and its emitted tokens
        self.recent_tokens: deque[int] = deque(maxlen=self.config.history)  # of each speculative step
        self.stream: deque[tuple[float, int]] = deque(maxlen=self.config.stream_steps)  # (seconds, tokens)
        self.fallbacks = 0
        self.plain_age = 0  # steps since a plain step last measured the plain speed
        self.pending: float | None = None  # a window's seconds per token, awaiting fresh plain steps
        self.fresh: list[float] = []  # the plain steps measured for it

    def begin_request(self) -> None:
        """A new request of the stream: its acceptance starts afresh (`history`); the plain time
        and an open window carry over, and so does a backoff, unless the stream pays
        (`stream_pays`): then the request starts drafting."""
        self.recent_tokens.clear()
        if self.plain_left > 0 and self.pending is None and self.stream_pays():
            self.plain_left = 0
            self.current_backoff = self.config.backoff

    def stream_pays(self) -> bool:
        """Whether the stream's recent speculative steps (at least two windows of them) cost
        less per token than plain steps."""
        plain = self.plain_seconds_per_token
        if plain is None or len(self.stream) < 2 * self.config.window:
            return False
        seconds, tokens = zip(*self.stream)
        return window_seconds_per_token(list(seconds), list(tokens)) * self.config.margin <= plain

    @property
    def plain_seconds_per_token(self) -> float | None:
        """The median of the recent plain steps (None before the first)."""
        return statistics.median(self.plain_steps) if self.plain_steps else None

    def speculate_now(self) -> bool:
        return self.plain_left <= 0

    def plain_next(self) -> bool:
        """This step and the next one are plain whatever this step measures (a judgement only
        lengthens a run of plain steps): a proposer that reads this step's pass for its next
        draft (EAGLE-3's taps) need not have it."""
        return self.plain_left >= 2

    def record_plain(self, seconds: float) -> None:
        self.plain_steps.append(seconds)
        self.plain_left -= 1
        self.plain_age = 0
        if self.pending is None:
            return
        self.fresh.append(seconds)
        if len(self.fresh) >= self.config.refresh_steps:  # the window judged against fresh plain steps
            self.plain_steps.clear()
            self.plain_steps.extend(self.fresh)
            speculative, self.pending, self.fresh = self.pending, None, []
            self._judge(speculative)

    def record_speculative(self, seconds: float, emitted: int) -> None:
        if not self.config.enabled:
            return
        self.plain_age += 1
        self.window_seconds.append(seconds)
        self.window_tokens.append(emitted)
        self.recent_tokens.append(emitted)
        self.stream.append((seconds, emitted))
        plain = self.plain_seconds_per_token
        if len(self.window_seconds) < self.config.window or plain is None:
            return
        recent = self.recent_tokens  # this request's; fewer than a window: the window's own tokens
        tokens_per_step = sum(recent) / len(recent) if len(recent) >= self.config.window else None
        speculative = window_seconds_per_token(self.window_seconds, self.window_tokens, tokens_per_step)
        self.window_seconds, self.window_tokens = [], []
        if speculative * self.config.margin > plain and self.plain_age > self.config.stale_after:
            self.pending, self.fresh = speculative, []  # measure plain again before judging
            self.plain_left = self.config.refresh_steps
            return
        self._judge(speculative)

    def _judge(self, speculative: float) -> None:
        """A window's seconds per token against the plain speed: a fallback if slower."""
        if speculative * self.config.margin > self.plain_seconds_per_token:
            self.plain_left = self.current_backoff
            self.current_backoff = min(self.current_backoff * 2, self.config.max_backoff)
            self.fallbacks += 1
        else:
            self.current_backoff = self.config.backoff


def window_seconds_per_token(seconds: list[float], tokens: list[int], tokens_per_step: float | None = None) -> float:
    """A window's seconds per emitted token, its slowest step left out where that step took
    over OUTLIER times the window's median step (a burst of other work, not drafting).
    `tokens_per_step`: the window's mean step over this many tokens (the mean of a longer
    history, SpeculationPolicy) instead of over the tokens its own steps emitted."""
    slowest = max(range(len(seconds)), key=seconds.__getitem__)
    if len(seconds) >= 3 and seconds[slowest] > OUTLIER * statistics.median(seconds):
        seconds = seconds[:slowest] + seconds[slowest + 1 :]
        tokens = tokens[:slowest] + tokens[slowest + 1 :]
    if tokens_per_step is not None:
        return sum(seconds) / len(seconds) / max(tokens_per_step, 1e-9)
    return sum(seconds) / max(sum(tokens), 1)


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
