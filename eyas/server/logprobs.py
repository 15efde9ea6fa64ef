"""Log-probabilities in the OpenAI response shapes (engine entries: eyas/engine/logprobs.py).

Chat (`logprobs: true`, `top_logprobs: 0..20`), per choice and per stream chunk:
    {"content": [{"token": " Paris", "logprob": -0.01, "bytes": [32, 80, ...],
                  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}
Completions (`logprobs: 0..5`, `echo` adds the prompt's tokens first, the very first one
with null values, as OpenAI and vLLM do):
    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
     "text_offset": [...]}
As vLLM does, a completions `top_logprobs` dict also holds the chosen token (up to
logprobs + 1 entries). A token's string is its own decode (a byte-level piece that is not
whole UTF-8 shows as U+FFFD; `bytes` is that string's UTF-8).
"""

from __future__ import annotations

from typing import Any, Sequence

from eyas.engine.logprobs import TokenLogprob

FLOOR = -9999.0  # JSON has no -inf; vLLM reports this instead


class TokenStrings:
    """token id -> its text, decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.cache.get(token)
        if text is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            self.cache[token] = text
        return text


def finite(value: float) -> float:
    return max(value, FLOOR)


def chat_entry(token: int, logprob: float, strings: TokenStrings) -> dict[str, Any]:
    text = strings(token)
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], strings: TokenStrings) -> dict[str, Any]:
    content = []
    for entry in entries:
        item = chat_entry(entry.token, entry.logprob, strings)
        item["top_logprobs"] = [chat_entry(token, value, strings) for token, value in entry.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(entries: Sequence[TokenLogprob | None], tokens: Sequence[int],
                        strings: TokenStrings, text_offset: int) -> dict[str, Any]:
    """entries[i] belongs to tokens[i] (None: the prompt's first token, which nothing
    predicts); offsets count characters from `text_offset`."""
    body: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for token, entry in zip(tokens, entries):
        text = strings(token)
        body["tokens"].append(text)
        body["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            continue
        body["token_logprobs"].append(finite(entry.logprob))
        top = {strings(t): finite(v) for t, v in entry.top}
        top.setdefault(text, finite(entry.logprob))
        body["top_logprobs"].append(top)
    return body
