"""Two floors of the server's streaming path, without eyas's app or engine: the event loop CPU
of one streamed chunk, and of one wake-up from another thread.

1. A uvicorn server on a thread streams `--chunks` SSE chunks of an OpenAI-sized chat delta to a
   local client, once through Starlette's StreamingResponse (an async generator) and once through
   a raw ASGI send loop; the loop never sleeps between chunks. Reported: the server thread's CPU
   per chunk (the socket write included), median over rounds.
2. An idle event loop on a thread is woken `--wakes` times from another thread
   (`call_soon_threadsafe` of an empty callback, 4 ms apart, as an engine step posts its
   outputs), with asyncio's loop and with uvloop. Reported: the loop thread's CPU per wake.

Usage:
    PYTHONPATH=$PWD python scripts/http-loop-costs.py [--chunks 20000] [--wakes 1500] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import statistics
import threading
import time

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from starlette.responses import Response

from eyas.server.runner import BackgroundServer

CHUNK = ('data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"m",'
         '"choices":[{"index":0,"delta":{"content":" word"},"finish_reason":null}]}\n\n')


class SendLoop(Response):
    """The chunks through ASGI `send` directly, one message each."""

    def __init__(self, chunks: int) -> None:
        super().__init__(content=b"", media_type="text/event-stream")
        self.chunks = chunks

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        body = CHUNK.encode()
        for _ in range(self.chunks):
            await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def streaming(chunks: int, rounds: int) -> dict[str, list[float]]:
    app = FastAPI()

    async def generate():
        for _ in range(chunks):
            await asyncio.sleep(0)
            yield CHUNK

    @app.get("/streaming-response")
    async def streaming_response() -> Response:
        return StreamingResponse(generate(), media_type="text/event-stream")

    @app.get("/send-loop")
    async def send_loop() -> Response:
        return SendLoop(chunks)

    server = BackgroundServer(app).start()
    per_chunk: dict[str, list[float]] = {"/streaming-response": [], "/send-loop": []}
    try:
        for _ in range(rounds):
            for path, values in per_chunk.items():
                connection = http.client.HTTPConnection("127.0.0.1", server.port)
                before = thread_cpu(server.thread)
                connection.request("GET", path)
                response = connection.getresponse()
                while response.read(65536):
                    pass
                values.append((thread_cpu(server.thread) - before) / chunks * 1e6)
                connection.close()
    finally:
        server.stop()
    return per_chunk


def wake_ups(loop: asyncio.AbstractEventLoop, wakes: int) -> float:
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    time.sleep(0.1)
    before = thread_cpu(thread)
    for _ in range(wakes):
        loop.call_soon_threadsafe(lambda: None)
        time.sleep(0.004)
    spent = thread_cpu(thread) - before
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
    return spent / wakes * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--wakes", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    for path, values in streaming(args.chunks, args.rounds).items():
        print(f"{path}: server thread CPU per chunk, median {statistics.median(values):.1f} us "
              f"({min(values):.1f}-{max(values):.1f})")
    loops = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop
        loops["uvloop"] = uvloop.new_event_loop
    except ImportError:
        pass
    for name, factory in loops.items():
        print(f"{name}: loop thread CPU per wake-up from another thread: {wake_ups(factory(), args.wakes):.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
