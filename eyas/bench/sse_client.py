"""A small asyncio HTTP/1.1 client for streamed completions: the load generator's hot path.

Usage:
    for arrived, data in await post_events("http://127.0.0.1:8000/v1/chat/completions", payload):
        ...   # arrived: perf_counter() when the bytes came in; data: one SSE `data:` field (str)

The load generator shares the machine with the server it measures. A general client (httpx:
httpcore + h11 events + a line decoder, then the caller's JSON, a few hundred microseconds of
Python per streamed chunk) takes CPU from the server at every token, and with one request in
flight that is a visible share of a decode step. While a response streams, this client only
reads: each read's bytes are kept with their arrival time, and the stream is over at
`data: [DONE]` or when the server closes the connection (`Connection: close`). The chunked
framing and the SSE lines are taken apart once the response is complete, each `data:` line
with the arrival time of the read that completed it; JSON is left to the caller. No proxies,
redirects or compression (the benchmark's `--client httpx` has those).

A status other than 200 raises `HTTPStatusError` with the body (as text).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

READ_LIMIT = 1 << 20  # the longest line the reader accepts (a status line, a header, a chunk size)


class HTTPStatusError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body


class SSELines:
    """Bytes in, the values of complete `data:` lines out (str, stripped); other lines (blank
    event separators, comments, `event:` names) are skipped."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, piece: bytes) -> list[str]:
        lines = (self.pending + piece).split(b"\n")
        self.pending = lines.pop()  # an incomplete last line waits for the next piece
        return [line[5:].strip().decode() for line in lines if line.startswith(b"data:")]


def request_head(url: str, length: int) -> tuple[str, int, bool, bytes]:
    """(host, port, https, the request's head bytes) of a JSON POST to `url`."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL, got '{url}'")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = (f"POST {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n")
    return parts.hostname, parts.port or (443 if https else 80), https, head.encode("latin-1")


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the headers (lower-case names) of a response."""
    status_line = await reader.readline()
    fields = status_line.split(None, 2)
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/"):
        raise ConnectionError(f"not an HTTP response: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return int(fields[1]), headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


class ChunkedBody:
    """Incremental decoder of the chunked transfer coding: framed bytes in, body bytes out."""

    def __init__(self) -> None:
        self.buffer = b""
        self.left = 0  # data bytes of the current chunk still to come
        self.crlf = False  # the CRLF after a chunk's data is next
        self.done = False  # the last (empty) chunk was seen

    def feed(self, data: bytes) -> bytes:
        self.buffer += data
        out = []
        while not self.done:
            if self.left:
                piece = self.buffer[: self.left]
                if not piece:
                    break
                out.append(piece)
                self.buffer = self.buffer[len(piece):]
                self.left -= len(piece)
                self.crlf = not self.left
                continue
            if self.crlf:
                if len(self.buffer) < 2:
                    break
                self.buffer, self.crlf = self.buffer[2:], False
                continue
            end = self.buffer.find(b"\r\n")
            if end < 0:
                break
            size = int(self.buffer[:end].split(b";", 1)[0], 16)
            self.buffer = self.buffer[end + 2:]
            self.left, self.done = size, size == 0
        return b"".join(out)


DONE = b"\ndata: [DONE]"  # a line start: inside a JSON string a newline is escaped


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str],
                    until_done: bool) -> list[tuple[float, bytes]]:
    """The response body's reads as they came, (arrival time, bytes still framed), up to the
    close, the Content-Length, or (until_done) the read that brings `data: [DONE]`."""
    reads: list[tuple[float, bytes]] = []
    left = int(headers["content-length"]) if "content-length" in headers else -1
    tail = b"\n"  # the body starts a line
    while left != 0:
        piece = await reader.read(1 << 16)
        if not piece:
            break
        reads.append((time.perf_counter(), piece))
        left = max(left - len(piece), 0) if left > 0 else left
        if until_done and DONE in tail + piece:
            break
        tail = piece[-len(DONE):]
    return reads


def body_of(reads: list[tuple[float, bytes]], headers: dict[str, str]) -> list[tuple[float, bytes]]:
    """The reads with the chunked framing taken off (when the response is chunked)."""
    if "chunked" not in headers.get("transfer-encoding", "").lower():
        return reads
    decoder = ChunkedBody()
    return [(arrived, decoder.feed(piece)) for arrived, piece in reads]


def sse_data(body: list[tuple[float, bytes]]) -> list[tuple[float, str]]:
    """Every `data:` line's value (stripped), with the arrival of the read that completed it."""
    lines = SSELines()
    events = [(arrived, data) for arrived, piece in body for data in lines.feed(piece)]
    if body:  # a last line the server did not end with a newline
        events += [(body[-1][0], data) for data in lines.feed(b"\n")]
    return events


async def post_events(url: str, payload: dict[str, Any]) -> list[tuple[float, str]]:
    """POST `payload` as JSON; the (arrival time, data) of every SSE `data:` line of the answer."""
    body = json.dumps(payload).encode()
    host, port, https, head = request_head(url, len(body))
    reader, writer = await asyncio.open_connection(
        host, port, ssl=ssl.create_default_context() if https else None, limit=READ_LIMIT)
    try:
        writer.write(head + body)
        status, headers = await read_head(reader)
        reads = await read_body(reader, headers, until_done=status == 200)
    finally:
        writer.close()
    decoded = body_of(reads, headers)
    if status != 200:
        text = b"".join(piece for _, piece in decoded).decode(errors="replace")
        raise HTTPStatusError(status, text)
    return sse_data(decoded)
