"""Read a top-level JSON array one element at a time, surviving a cut-off or broken element.

The packaged ShareGPT file is a JSON array cut off inside its last record, so `json.load` fails
on the whole file. This reader decodes element by element with `json.JSONDecoder.raw_decode` on
a sliding window of the file (never the whole file in memory) and yields, per element, either
the decoded value or an `ElementError` that says why it was dropped and on which line it began:

    for item in iter_json_array(path):
        if isinstance(item, ElementError): ...   # "truncated" or "invalid JSON: ..."
        else: item.value, item.line

An element cut off by the end of the file is `truncated`; an element whose brackets balance but
which does not decode is `invalid JSON`, and reading goes on after it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

CHUNK_CHARS = 1 << 20

# A JSON string (an unterminated one runs to the end of the text) or a bracket: enough to find
# where an element ends without decoding it.
_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[\[\]{}]', re.DOTALL)
_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class Element:
    value: Any
    line: int  # 1-based line where the element starts


@dataclass(frozen=True)
class ElementError:
    reason: str  # "truncated" or "invalid JSON: ..."
    line: int


def _element_end(text: str, start: int) -> int | None:
    """Index just past the element that opens at `text[start]` ('{' or '['); None if unclosed."""
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(text, start):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
        elif token in ("]", "}"):
            depth -= 1
            if depth == 0:
                return match.end()
    return None


class _Window:
    """The unread part of a text file: `text[pos:]`, with `line` the line number at `pos`."""

    def __init__(self, handle: Any, chunk_chars: int) -> None:
        self.handle = handle
        self.chunk_chars = chunk_chars
        self.text = ""
        self.pos = 0
        self.line = 1
        self.at_eof = False

    def read_more(self) -> bool:
        if self.at_eof:
            return False
        chunk = self.handle.read(self.chunk_chars)
        if not chunk:
            self.at_eof = True
            return False
        self.text = self.text[self.pos :] + chunk  # drop what was consumed
        self.pos = 0
        return True

    def advance(self, end: int) -> None:
        self.line += self.text.count("\n", self.pos, end)
        self.pos = end

    def skip(self, characters: str) -> None:
        """Skip whitespace and `characters`, reading on when the window runs dry."""
        while True:
            end = self.pos
            while end < len(self.text) and self.text[end] in characters:
                end += 1
            self.advance(end)
            if self.pos < len(self.text) or not self.read_more():
                return

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""


def iter_json_array(path: str | Path, chunk_chars: int = CHUNK_CHARS) -> Iterator[Element | ElementError]:
    """Yield each element of the JSON array in `path` (see the module docstring)."""
    with open(path, encoding="utf-8") as handle:
        window = _Window(handle, chunk_chars)
        window.skip(_WHITESPACE)
        if window.peek() != "[":
            raise ValueError(f"{path} does not start with a JSON array ('[')")
        window.advance(window.pos + 1)
        while True:
            window.skip(_WHITESPACE + ",")
            if window.peek() in ("", "]"):
                return
            line = window.line
            # Fast path: the element decodes inside the window (a scalar that touches the end of
            # the window may go on in the next chunk, so it takes the slow path).
            try:
                value, end = _DECODER.raw_decode(window.text, window.pos)
                if isinstance(value, (dict, list)) or end < len(window.text) or window.at_eof:
                    window.advance(end)
                    yield Element(value, line)
                    continue
            except json.JSONDecodeError:
                pass
            item = _slow_element(window, line)
            yield item
            if isinstance(item, ElementError) and item.reason == "truncated":
                return


def _slow_element(window: _Window, line: int) -> Element | ElementError:
    """Read on until the element at the window's position ends, then decode it or say why not."""
    if window.peek() not in ("[", "{"):
        # A scalar: read the rest of the file (scalars are short) and decode once more.
        while window.read_more():
            pass
        try:
            value, end = _DECODER.raw_decode(window.text, window.pos)
        except json.JSONDecodeError as error:
            window.advance(len(window.text))
            return ElementError(f"invalid JSON: {error.msg}", line)
        window.advance(end)
        return Element(value, line)
    # 1. Read on until the element's brackets close or the file ends.
    end = _element_end(window.text, window.pos)
    while end is None and window.read_more():
        end = _element_end(window.text, window.pos)
    if end is None:
        # 2. The file ends inside the element: it is truncated and nothing follows it.
        window.advance(len(window.text))
        return ElementError("truncated", line)
    # 3. It closes: it decodes, or it is broken and reading goes on after it.
    text = window.text[window.pos : end]
    window.advance(end)
    try:
        return Element(json.loads(text), line)
    except json.JSONDecodeError as error:
        return ElementError(f"invalid JSON: {error.msg}", line)
