"""`Sequence`: one request's output as it grows: EOS, max_tokens, stop strings, text deltas.

Tokens are appended one at a time, so that a speculative step that yields several tokens is cut
exactly where plain decoding would have stopped (EOS, a stop string, or max_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from eyas.engine.sampling import SamplingParams


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens (EOS excluded)
    text: str  # decoded, cut before any stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)  # timings, speculative metrics
    # With SamplingParams.logprobs / prompt_logprobs (engine/logprobs.py): one TokenLogprob per
    # generated token (an EOS that ended the answer included); one per prompt token (None first)
    logprobs: list | None = None
    prompt_logprobs: list | None = None


def window_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """ids -> tokenizer.decode(ids, skip_special_tokens=True). A Hugging Face fast tokenizer
    that does no clean-up of spaces is asked through its Rust backend directly: the same text
    without the Python wrapper around it (a fifth of the cost per call)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and not getattr(
            tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer: Any,
                 eos_token_ids: set[int], max_new_tokens: int | None = None) -> None:
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.max_new_tokens = min(params.max_tokens, max_new_tokens or params.max_tokens)
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self._text = ""  # decoded text of output_ids (stop strings not yet cut)
        self._decoded_upto = 0  # tokens folded into _text
        self._prefix_start = 0  # window start for incremental decoding
        self._emitted = 0  # characters already handed to the caller
        self._stop_at: int | None = None  # text cut position when a stop string matched
        self._decode = window_decoder(tokenizer)
        self._window_text: str | None = None  # decoded ids[_prefix_start:_decoded_upto], if known

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def append(self, tokens: list[int]) -> int:
        """Append tokens until the sequence finishes; return how many were taken."""
        taken = 0
        for token in tokens:
            if self.finished:
                break
            taken += 1
            if token in self.eos_token_ids:
                self.finish_reason = "stop"
                break
            self.output_ids.append(token)
            self._decode_new()
            if self.params.stop and self._find_stop():
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
        return taken

    def _decode_new(self) -> None:
        # Incremental detokenization: decode a short window so that multi-token characters and
        # leading-space rules come out as in a full decode.
        # The window's text before this token is the last call's `after` unless the window moved.
        ids = self.output_ids
        before = self._window_text
        if before is None:
            before = self._decode(ids[self._prefix_start : self._decoded_upto])
        after = self._decode(ids[self._prefix_start :])
        if after.endswith("\ufffd"):
            self._window_text = before
            return  # an incomplete UTF-8 character: wait for the next token
        self._text += after[len(before) :]
        self._decoded_upto = len(ids)
        self._window_text = after
        if self._decoded_upto - self._prefix_start > 8:
            self._prefix_start = self._decoded_upto - 4
            self._window_text = None

    def _find_stop(self) -> bool:
        longest = max(len(s) for s in self.params.stop)
        window_start = max(0, len(self._text) - longest - 16)
        hits = [i for s in self.params.stop if (i := self._text.find(s, window_start)) >= 0]
        if hits:
            self._stop_at = min(hits)
            return True
        return False

    @property
    def text(self) -> str:
        return self._text if self._stop_at is None else self._text[: self._stop_at]

    def take_new_text(self) -> str:
        """Text not yet handed out, holding back a tail that could start a stop string."""
        text = self.text
        safe = len(text)
        if not self.finished and self.params.stop:
            hold = max(len(s) for s in self.params.stop) - 1
            safe = max(self._emitted, len(text) - hold)
        delta = text[self._emitted : safe]
        self._emitted = safe
        return delta
