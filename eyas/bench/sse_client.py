"""A small HTTP/1.1 client for streamed completions: the load generator's hot path.

Usage:
    for arrived, data in await post_events("http://127.0.0.1:8000/v1/chat/completions", payload):
        ...   # arrived: perf_counter() when the bytes came in; data: one SSE `data:` field (str)

The load generator shares the machine with the server it measures. A general client (httpx:
httpcore + h11 events + a line decoder, then the caller's JSON, a few hundred microseconds of
Python per streamed chunk) takes CPU from the server at every token, and with one request in
flight that is a visible share of a decode step. Here each streamed request is read by a
blocking socket on a thread of its own (the event loop waits for the whole answer, not for
every chunk), and while a response streams the thread only receives: each read's bytes are
kept with their arrival time, and the stream is over at `data: [DONE]` or when the server
closes the connection (`Connection: close`). The chunked framing and the SSE lines are taken
apart once the response is complete, each `data:` line with the arrival time of the read that
completed it; JSON is left to the caller. No proxies, redirects or compression (the
benchmark's `--client httpx` has those).

A status other than 200 raises `HTTPStatusError` with the body (as text).
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

READ_SIZE = 1 << 16  # bytes asked of each recv
MAX_HEAD = 1 << 20  # the longest status line + headers accepted
MAX_STREAMS = 4096  # threads of the readers' pool (made as needed: one per request in flight)
DONE = b"\ndata: [DONE]"  # a line start: inside a JSON string a newline is escaped


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


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """The status code and the headers (lower-case names) of a response head."""
    status_line, *lines = head.decode("latin-1").split("\r\n")
    fields = status_line.split(None, 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/"):
        raise ConnectionError(f"not an HTTP response: {status_line[:80]!r}")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(fields[1]), headers


class BlockingStream:
    """One request on a blocking socket: `run` (on a reader thread) sends it and returns the
    status, the headers and the body's reads; `abort` (any thread) ends a `run` in progress."""

    def __init__(self, url: str, payload: dict[str, Any], connect_timeout: float = 30.0) -> None:
        body = json.dumps(payload).encode()
        self.host, self.port, self.https, head = request_head(url, len(body))
        self.request = head + body
        self.connect_timeout = connect_timeout
        self.sock: socket.socket | None = None
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # a recv in progress returns b""
            except OSError:
                pass

    def run(self) -> tuple[int, dict[str, str], list[tuple[float, bytes]]]:
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        if self.https:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        sock.settimeout(None)
        self.sock = sock
        try:
            if self.aborted.is_set():
                raise ConnectionAbortedError("the request was cancelled")
            sock.sendall(self.request)
            received = b""
            while b"\r\n\r\n" not in received:
                piece = sock.recv(READ_SIZE)
                if not piece or len(received) > MAX_HEAD:
                    raise ConnectionError("the connection ended before a complete response head")
                received += piece
            head, rest = received.split(b"\r\n\r\n", 1)
            status, headers = parse_head(head)
            reads = [(time.perf_counter(), rest)] if rest else []
            return status, headers, read_body(sock.recv, headers, reads, until_done=status == 200)
        finally:
            self.sock = None
            sock.close()


def read_body(recv, headers: dict[str, str], reads: list[tuple[float, bytes]],
              until_done: bool) -> list[tuple[float, bytes]]:
    """The response body's reads as they came, (arrival time, bytes still framed): `reads`
    (made with the head), then `recv(size)` until the close, the Content-Length, or (until_done)
    the read that brings `data: [DONE]`."""
    left = int(headers["content-length"]) if "content-length" in headers else -1
    tail, index = b"\n", 0  # the body starts a line
    while left != 0:
        if index < len(reads):
            piece = reads[index][1]
        else:
            piece = recv(READ_SIZE)
            if not piece:
                break
            reads.append((time.perf_counter(), piece))
        index += 1
        left = max(left - len(piece), 0) if left > 0 else left
        if until_done and DONE in tail + piece:
            break
        tail = piece[-len(DONE):]
    return reads


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


_readers: ThreadPoolExecutor | None = None


def readers() -> ThreadPoolExecutor:
    """The reader threads (one per request in flight, kept for the next requests)."""
    global _readers
    if _readers is None:
        _readers = ThreadPoolExecutor(MAX_STREAMS, thread_name_prefix="sse-reader")
    return _readers


async def post_events(url: str, payload: dict[str, Any]) -> list[tuple[float, str]]:
    """POST `payload` as JSON; the (arrival time, data) of every SSE `data:` line of the answer.
    Cancelling the call (a timeout) closes the connection."""
    stream = BlockingStream(url, payload)
    try:
        status, headers, reads = await asyncio.get_running_loop().run_in_executor(readers(), stream.run)
    except asyncio.CancelledError:
        stream.abort()
        raise
    decoded = body_of(reads, headers)
    if status != 200:
        text = b"".join(piece for _, piece in decoded).decode(errors="replace")
        raise HTTPStatusError(status, text)
    return sse_data(decoded)
