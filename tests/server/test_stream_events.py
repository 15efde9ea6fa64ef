"""The text-only stream event made from framing built once per choice is byte for byte the
event built from the whole chunk; every other output takes the general path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eyas.scheduler.request import RequestOutput
from eyas.server.app import sse
from eyas.server.choices import Choice
from eyas.server.format import ChoiceView

TEXTS = [" the", "", "quote \" and \\ back", "line\nbreak\ttab", "naïve — 日本語 🙂", "\x00\x1f", "}\"]"]


def view(chat: bool = True, logprobs: bool = False) -> ChoiceView:
    parsed = SimpleNamespace(output_logprobs=1 if logprobs else None, echo=False, prompts=lambda: ["p"])
    return ChoiceView(parsed, tokenizer=None, chat=chat)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("index", [0, 3])
def test_text_event_is_the_general_event_byte_for_byte(include_usage, index):
    chat_view = view()
    choice = Choice(index, 0, [1, 2])
    model = 'odd "model" \x00 name'
    for text in TEXTS:
        output = RequestOutput("r", text, [5], False, None, 2, 1)
        fast = chat_view.text_event(choice, output, "chatcmpl-1", model, 1700000000, include_usage)
        chunk = chat_view.chunk(choice, output, "chatcmpl-1", model, 1700000000, include_usage)
        if not text:
            assert fast is None and chunk is None
            continue
        assert fast == sse(chunk)


def test_other_outputs_take_the_general_path():
    choice = Choice(0, 0, [1])
    args = ("chatcmpl-1", "m", 1, False)
    finished = RequestOutput("r", "x", [5], True, "stop", 2, 1)
    assert view().text_event(choice, finished, *args) is None
    text = RequestOutput("r", "x", [5], False, None, 2, 1)
    assert view(logprobs=True).text_event(choice, text, *args) is None
    assert view(chat=False).text_event(choice, text, *args) is None
