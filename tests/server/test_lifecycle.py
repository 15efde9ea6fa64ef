"""Cancellation when a client disconnects, SIGTERM draining (with open streams and a drain
timeout), and a bounded loopback load test."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from server_support import start_server
from eyas.server.runner import free_port


def slow_steps(served, seconds: float) -> None:
    """Make every engine step take at least `seconds` (so that a request lasts a while)."""
    run_step = served.engine.executor.run

    def slow(plan):
        time.sleep(seconds)
        return run_step(plan)
    served.engine.executor.run = slow


def wait_until(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def aborted(served) -> float:
    return served.metrics.success.labels(model_name=served.name, engine="0",
                                         finished_reason="abort")._value.get()


def test_client_disconnect_cancels_the_request(tiny_target):
    served = start_server(tiny_target, max_running=2)
    slow_steps(served, 0.01)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 200,
            "ignore_eos": True}
    try:
        # 1. A stream closed after its first chunks.
        with httpx.stream("POST", served.url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        assert wait_until(lambda: aborted(served) == 1 and served.engine.num_running == 0)
        # 2. A non-streaming request whose client gives up.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/chat/completions", json=body, timeout=0.5)
        assert wait_until(lambda: aborted(served) == 2 and served.engine.num_running == 0)
        # 3. Everyone else is still served.
        done = served.client().chat.completions.create(model="tiny", messages=body["messages"], max_tokens=3)
        assert done.choices[0].finish_reason == "length"
    finally:
        served.server.stop()


def serve_process(tiny_model_dir, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "eyas.cli.serve", "--model", str(tiny_model_dir), "--dtype",
               "float32", "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning",
               *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, f"http://127.0.0.1:{port}"


def test_sigterm_finishes_in_flight_requests_then_exits(tiny_model_dir):
    process, url = serve_process(tiny_model_dir)
    try:
        assert wait_until(lambda: _healthy(url), timeout=90), "the server did not start"
        body = {"model": "tiny", "prompt": "tick tock", "max_tokens": 120, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:
                    process.send_signal(signal.SIGTERM)  # mid-stream
        assert events[-1] == "data: [DONE]"
        usage = json.loads(events[-2][len("data: "):])["usage"]
        assert usage["completion_tokens"] == 120  # the in-flight request was finished
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_with_open_streams_ends_each_with_a_final_event(tiny_model_dir):
    """More streams than rows, SIGTERM while they run, a 0.5 s drain: every stream ends with a
    final chunk (finish_reason length if it finished in time, else abort) and [DONE]; the
    answers that finished are whole; a request that finished before the signal is intact."""
    process, url = serve_process(tiny_model_dir, "--max-running", "2", "--drain-timeout", "0.5")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 220,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    streams: dict[int, list[str]] = {}
    started = [threading.Event() for _ in range(8)]

    def read_stream(index: int) -> None:
        lines = streams.setdefault(index, [])
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    started[index].set()

    try:
        assert wait_until(lambda: _healthy(url), timeout=90), "the server did not start"
        before = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 5},
                            timeout=60)
        assert before.status_code == 200 and before.json()["usage"]["completion_tokens"] == 5
        threads = [threading.Thread(target=read_stream, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        assert all(event.wait(60) for event in started)  # every stream is open
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(90)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reasons = []
    for index, lines in sorted(streams.items()):
        assert lines[-1] == "data: [DONE]", (index, lines[-3:])
        events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        final = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(final) == 1, (index, lines[-3:])
        reason = final[0]["choices"][0]["finish_reason"]
        usage = events[-1]["usage"]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
        assert reason in ("length", "abort")
        if reason == "length":  # a finished answer is whole
            assert usage["completion_tokens"] == 220 and text
        reasons.append(reason)
    assert len(reasons) == 8 and "abort" in reasons  # the drain ran out: 4 rounds of 220 steps


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_loopback_load_loses_no_request(tiny_target):
    """A few hundred small requests, 32 at a time: every one completes, the server stays healthy."""
    served = start_server(tiny_target, draft="ngram", max_running=16, max_waiting=512)
    total, concurrency = 300, 32

    async def load():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=60)
        gate = asyncio.Semaphore(concurrency)

        async def one(index):
            async with gate:
                if index % 3 == 0:
                    stream = await client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": f"request {index}"}],
                        max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True})
                    chunks = [chunk async for chunk in stream]
                    return chunks[-1].usage.completion_tokens
                response = await client.completions.create(model="tiny", prompt=f"request {index}",
                                                           max_tokens=6, temperature=0,
                                                           extra_body={"ignore_eos": True})
                return response.usage.completion_tokens
        try:
            return await asyncio.gather(*(one(i) for i in range(total)))
        finally:
            await client.close()

    try:
        started = time.monotonic()
        completions = asyncio.run(load())
        elapsed = time.monotonic() - started
        assert len(completions) == total and all(1 <= n <= 6 for n in completions)
        assert httpx.get(served.url + "/health").json() == {"status": "ok"}
        assert wait_until(lambda: served.engine.num_running == 0 and served.engine.num_waiting == 0)
        succeeded = sum(served.metrics.success.labels(model_name="tiny", engine="0", finished_reason=r)._value.get()
                        for r in ("stop", "length"))
        assert succeeded == total
        assert elapsed < 120
    finally:
        served.server.stop()
