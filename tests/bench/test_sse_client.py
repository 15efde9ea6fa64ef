"""The load generator's small HTTP client: chunked framing and SSE lines taken apart after the
fact, split anywhere; a stream ends at `data: [DONE]` and nowhere else; errors keep their body."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from eyas.bench.sse_client import (ChunkedBody, HTTPStatusError, SSELines, body_of, post_events,
                                   read_body, sse_data)
from synthetic_server import Behaviour, SyntheticServer


def chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


EVENTS = [json.dumps({"choices": [{"delta": {"content": text}}]}) for text in
          ["Hello", " wor\nld", " data: [DONE] is text here", "!"]] + ["[DONE]"]
BODY = [f"data: {event}\n\n".encode() for event in EVENTS]


@pytest.mark.parametrize("seed", range(5))
def test_framing_and_lines_survive_any_split(seed):
    framed = chunked(BODY)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(framed)), 12))
    reads = [(float(i), framed[a:b]) for i, (a, b) in enumerate(zip([0] + cuts, cuts + [len(framed)]))]
    decoder = ChunkedBody()
    body = b"".join(decoder.feed(piece) for _, piece in reads)
    assert body == b"".join(BODY) and decoder.done
    events = sse_data(body_of(reads, {"transfer-encoding": "chunked"}))
    assert [data for _, data in events] == EVENTS
    # Each event carries the time of the read that brought its line's newline (the first of
    # the two that end an event; the reads' times are 0, 1, ...).
    newlines = [len(chunked(BODY[: i + 1])) - len(b"0\r\n\r\n") - 4 for i in range(len(BODY))]
    expected = [float(sum(1 for cut in cuts if cut <= at)) for at in newlines]
    assert [t for t, _ in events] == expected


def test_sse_lines_skip_comments_and_keep_an_unterminated_last_line():
    lines = SSELines()
    assert lines.feed(b": ping\nevent: x\ndata: {\"a\"") == []
    assert lines.feed(b": 1}\r\n\r\ndata: 2") == ['{"a": 1}']
    assert sse_data([(1.0, b"data: 1\n\ndata: [DONE]")]) == [(1.0, "1"), (1.0, "[DONE]")]


def test_reading_stops_at_done_and_not_at_done_inside_a_text():
    def run(pieces: list[bytes], until_done: bool, headers: dict | None = None,
            first: list[bytes] = ()) -> list[bytes]:
        queue = list(pieces)

        def recv(size: int) -> bytes:  # one piece per read, then the close
            return queue.pop(0) if queue else b""

        reads = read_body(recv, headers or {}, [(0.0, piece) for piece in first], until_done)
        return [piece for _, piece in reads]

    pieces = [BODY[0], BODY[2], BODY[4], b"data: late\n\n"]
    assert run(pieces, True) == pieces[:3]  # BODY[2]'s text says data: [DONE]
    assert run(pieces, False) == pieces
    assert run(pieces[1:], True, first=pieces[:1]) == pieces[:3]  # bytes that came with the head
    assert run(pieces[2:], True, first=pieces[:2]) == pieces[:3]
    sized = {"content-length": str(len(BODY[0]) + 3)}
    assert run([BODY[0], b"abc", b"never read"], False, sized) == [BODY[0], b"abc"]


def test_against_a_server_and_an_error_body():
    async def run(url: str, payload: dict) -> list[tuple[float, str]]:
        return await post_events(url, payload)

    with SyntheticServer(Behaviour(ttft_ms=5, itl_ms=5, tokens=5)) as server:
        payload = {"model": "synthetic-model", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        events = asyncio.run(run(server.url + "/v1/chat/completions", payload))
        assert events[-1][1] == "[DONE]"
        chunks = [json.loads(data) for _, data in events[:-1]]
        text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
        assert len(text.split()) == 5
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        times = [t for t, _ in events]
        assert times == sorted(times) and times[-1] - times[1] >= 0.004 * 3  # 5 ms apart at least
        with pytest.raises(HTTPStatusError) as caught:
            asyncio.run(run(server.url + "/v1/chat/completions", {**payload, "model": "other"}))
        assert caught.value.status == 404 and "other" in caught.value.body
