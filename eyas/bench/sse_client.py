"""A small asyncio HTTP/1.1 client for streamed completions: the load generator's hot path.

Usage:
    async for arrived, data in post_events("http://127.0.0.1:8000/v1/chat/completions", payload):
        ...   # arrived: perf_counter() when the bytes came in; data: one SSE `data:` field (str)

The load generator shares the machine with the server it measures. A general client (httpx:
httpcore + h11 events + a line decoder, a few hundred microseconds of Python per streamed
chunk) takes CPU from the server at every token, and at one request in flight that is a
visible share of a decode step. This client does only what a streamed completion needs: one
connection per request (`Connection: close`), the status line and headers, the chunked or
sized body, and the SSE lines; JSON is left to the caller. No proxies, no redirects, no
compression (the benchmark's `--client httpx` has those).

A status other than 200 raises `HTTPStatusError` with the body (as text) read in full.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from typing import Any, AsyncIterator
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


async def body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives: chunked transfer coding, a Content-Length, or up to the close."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readline()).split(b";", 1)[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            piece = await reader.readexactly(size)
            await reader.readexactly(2)  # the CRLF after the chunk
            yield piece
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            piece = await reader.read(min(left, 1 << 16))
            if not piece:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(piece)
            yield piece
    else:
        while piece := await reader.read(1 << 16):
            yield piece


async def post_events(url: str, payload: dict[str, Any]) -> AsyncIterator[tuple[float, str]]:
    """POST `payload` as JSON and yield (arrival time, data) for every SSE `data:` line."""
    body = json.dumps(payload).encode()
    host, port, https, head = request_head(url, len(body))
    reader, writer = await asyncio.open_connection(
        host, port, ssl=ssl.create_default_context() if https else None, limit=READ_LIMIT)
    try:
        writer.write(head + body)
        status, headers = await read_head(reader)
        if status != 200:
            text = b"".join([piece async for piece in body_pieces(reader, headers)])
            raise HTTPStatusError(status, text.decode(errors="replace"))
        lines = SSELines()
        async for piece in body_pieces(reader, headers):
            arrived = time.perf_counter()
            for data in lines.feed(piece):
                yield arrived, data
    finally:
        writer.close()
