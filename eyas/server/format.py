"""Choices as the client sees them: text (with `echo`, the prompt first) and logprobs, whole
(one response body) or as stream chunks.

Usage (inside a route):
    view = ChoiceView(parsed, tokenizer, chat=False)
    body_choices = [view.whole(choice) for choice in choices.choices]
    chunk = view.chunk(choice, output, response_id, model, created, include_usage)
    line = view.text_event(choice, output, response_id, model, created, include_usage)  # or None
"""

from __future__ import annotations

import json
from typing import Any

from json.encoder import encode_basestring_ascii as encode_string  # json.dumps(str)'s own, in C

from eyas.engine.logprobs import TokenLogprob
from eyas.scheduler.request import RequestOutput
from eyas.server import protocol
from eyas.server.choices import Choice
from eyas.server.logprobs import TokenStrings, chat_logprobs, completion_logprobs


class ChoiceView:
    def __init__(self, parsed: Any, tokenizer: Any, chat: bool) -> None:
        self.chat = chat
        self.tokenizer = tokenizer
        self.strings = TokenStrings(tokenizer)
        self.logprobs = parsed.output_logprobs is not None
        self.echo = not chat and bool(parsed.echo)
        self.raw_prompts = [] if chat else parsed.prompts()
        self._framing: dict[int, tuple[str, str]] = {}  # text_event's, per choice index

    def prompt_text(self, choice: Choice) -> str:
        """The prompt as sent (a string), or its token ids decoded."""
        raw = self.raw_prompts[choice.prompt_index]
        return raw if isinstance(raw, str) else self.tokenizer.decode(choice.prompt_ids)

    def whole(self, choice: Choice) -> dict[str, Any]:
        """One choice of a response body."""
        final = choice.final
        reason = final.finish_reason if final is not None else None
        if self.chat:
            logprobs = chat_logprobs(choice.logprobs, self.strings) if self.logprobs else None
            return protocol.chat_choice(choice.index, choice.text, reason, logprobs)
        prefix = self.prompt_text(choice) if self.echo else ""
        logprobs = None
        if self.logprobs:
            entries, tokens = self._prompt_entries(choice) if self.echo else ([], [])
            entries += choice.logprobs
            tokens += [entry.token for entry in choice.logprobs]
            logprobs = completion_logprobs(entries, tokens, self.strings,
                                           0 if self.echo else len(self.prompt_text(choice)))
        return protocol.completion_choice(choice.index, prefix + choice.text, reason, logprobs)

    def chunk(self, choice: Choice, output: RequestOutput, response_id: str, model: str,
              created: int, include_usage: bool) -> dict[str, Any] | None:
        """The stream chunk for one output of one choice (None: nothing to send)."""
        reason = output.finish_reason if output.finished else None
        entries: list[TokenLogprob | None] = list(output.logprobs or []) if self.logprobs else []
        if self.chat:
            if not (output.text or entries or output.finished):
                return None
            logprobs = chat_logprobs(entries, self.strings) if entries else None
            delta = {"content": output.text} if output.text else {}
            return protocol.chat_chunk(response_id, model, created, delta, reason, include_usage,
                                       choice.index, logprobs)
        text, tokens = output.text, [entry.token for entry in entries]
        if not choice.started:  # the first chunk of a choice: the prompt first, with echo
            choice.started = True
            if self.echo:
                text = self.prompt_text(choice) + text
                if self.logprobs:
                    prompt_entries, prompt_tokens = self._prompt_entries(choice)
                    entries, tokens = prompt_entries + entries, prompt_tokens + tokens
            elif self.logprobs:
                choice.offset = len(self.prompt_text(choice))
        if not (text or entries or output.finished):
            return None
        logprobs = None
        if self.logprobs and entries:
            logprobs = completion_logprobs(entries, tokens, self.strings, choice.offset)
            choice.offset += sum(len(self.strings(token)) for token in tokens)
        return protocol.completion_chunk(response_id, model, created, text, reason, include_usage,
                                         choice.index, logprobs)

    def text_event(self, choice: Choice, output: RequestOutput, response_id: str, model: str,
                   created: int, include_usage: bool) -> str | None:
        """The SSE event of an unfinished chat output that carries only text, as the bytes
        `sse(chunk(...))` would send, without building and encoding the chunk each token
        (the JSON around the text is made once per choice); None for any other output."""
        if not self.chat or self.logprobs or output.finished or not output.text:
            return None
        framing = self._framing.get(choice.index)
        if framing is None:
            marker = "\x00"
            whole = json.dumps(protocol.chat_chunk(response_id, model, created, {"content": marker},
                                                   None, include_usage, choice.index),
                               separators=(",", ":"))
            head, tail = whole.rsplit(json.dumps(marker), 1)  # the content is the last string
            framing = self._framing[choice.index] = ("data: " + head, tail + "\n\n")
        return framing[0] + encode_string(output.text) + framing[1]

    def _prompt_entries(self, choice: Choice) -> tuple[list[TokenLogprob | None], list[int]]:
        """The prompt's logprob entries (None for the first token) and its token ids."""
        entries = list(choice.prompt_logprobs or [None] * len(choice.prompt_ids))
        return entries, list(choice.prompt_ids)
