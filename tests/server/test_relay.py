"""Engine outputs on their way to the event loop: a burst from the engine thread is one
wake-up, in order; a stream that fell behind gets its pending outputs merged into one, with
the same text, tokens, logprobs and totals as the outputs one by one."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from eyas.engine.logprobs import TokenLogprob
from eyas.engine.sampling import SamplingParams
from eyas.scheduler.request import RequestOutput
from eyas.server.choices import ChoiceSet, merged
from eyas.server.relay import OutputRelay


class FakeEngine:
    """Takes submissions; the test calls their callbacks as the engine thread would."""

    def __init__(self) -> None:
        self.callbacks = []
        self.aborted = []

    def submit(self, prompt_ids, params, on_output, logits_processors=()):
        self.callbacks.append(on_output)
        return SimpleNamespace(request_id=f"r{len(self.callbacks)}")

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def output(text: str, tokens: list[int], done: int, finished: bool = False, reason: str | None = None,
           logprobs: bool = False) -> RequestOutput:
    entries = [TokenLogprob(t, -0.5 * t) for t in tokens] if logprobs else None
    return RequestOutput("r1", text, tokens, finished, reason, 7, done, logprobs=entries,
                         speculative={"method": "x"} if finished else None)


class Receiver:
    def __init__(self) -> None:
        self.deliveries: list[list] = []

    def deliver(self, items: list) -> None:
        self.deliveries.append(items)


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    """asyncio's own loop, or uvloop's (what uvicorn runs where uvloop is installed)."""
    if kind == "uvloop":
        return pytest.importorskip("uvloop").new_event_loop()
    return asyncio.new_event_loop()


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_burst_from_another_thread_is_one_delivery_per_receiver_in_order(loop_kind):
    async def run() -> tuple[Receiver, Receiver, int]:
        loop = asyncio.get_running_loop()
        relay = OutputRelay.of(loop)
        assert OutputRelay.of(loop) is relay
        first, second = Receiver(), Receiver()
        wakeups = 0
        drain = relay._drain

        def counted() -> None:
            nonlocal wakeups
            wakeups += 1
            drain()

        relay._drain = counted

        def engine_step() -> None:  # one step's outputs, emitted back to back
            for i in range(16):
                relay.post(first if i % 2 == 0 else second, i)

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()  # the loop is not running meanwhile: every post joins the first wake-up
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        relay.post(first, 16)  # a later step: a wake-up of its own
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return first, second, wakeups

    loop = new_loop(loop_kind)
    try:
        first, second, wakeups = loop.run_until_complete(run())
    finally:
        loop.close()
    assert wakeups == 2
    assert first.deliveries == [[0, 2, 4, 6, 8, 10, 12, 14], [16]]
    assert second.deliveries == [[1, 3, 5, 7, 9, 11, 13, 15]]


def test_merged_outputs_keep_text_tokens_logprobs_and_the_last_totals():
    a = output("Hel", [1], 1, logprobs=True)
    b = output("lo", [2, 3], 3, logprobs=True)
    c = output("!", [4], 4, finished=True, reason="length", logprobs=True)
    one = merged(merged(a, b), c)
    assert (one.text, one.token_ids, one.completion_tokens) == ("Hello!", [1, 2, 3, 4], 4)
    assert [entry.token for entry in one.logprobs] == [1, 2, 3, 4]
    assert one.finished and one.finish_reason == "length" and one.speculative == {"method": "x"}
    assert (a.text, a.token_ids, len(a.logprobs)) == ("Hel", [1], 1)  # the inputs are untouched


def choice_set_with(outputs: list[RequestOutput], merge: bool, n: int = 1) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        engine = FakeEngine()
        choices = ChoiceSet(engine, asyncio.get_running_loop())
        choices.submit([[1, 2, 3]], n, lambda ids: SamplingParams(max_tokens=8), lambda ids, p: [])
        for item in outputs:  # all delivered before the stream reads any
            engine.callbacks[0](item)
        for callback in engine.callbacks[1:]:
            callback(output("", [], 0, finished=True, reason="stop"))
        seen = []
        while not choices.finished:
            choice, got = await choices.next(merge=merge)
            if choice.index == 0:
                seen.append(got)
        assert choices.choices[0].text == "".join(o.text for o in outputs)
        return seen

    return asyncio.run(run())


def test_a_stream_that_fell_behind_reads_one_merged_output():
    outputs = [output("a", [1], 1), output("b", [2], 2), output("c", [3], 3, finished=True, reason="stop")]
    assert [o.text for o in choice_set_with(outputs, merge=False)] == ["a", "b", "c"]
    merged_outputs = choice_set_with(outputs, merge=True)
    assert [(o.text, o.token_ids, o.finished, o.completion_tokens) for o in merged_outputs] == \
        [("abc", [1, 2, 3], True, 3)]
    # Several choices: outputs stay one by one (each chunk names its choice).
    assert [o.text for o in choice_set_with(outputs, merge=True, n=2)] == ["a", "b", "c"]


def test_a_failed_output_is_never_merged_into_another():
    outputs = [output("a", [1], 1), output("b", [2], 2),
               RequestOutput("r1", "", [], True, "error", 7, 2, error="step: boom")]
    seen = choice_set_with(outputs, merge=True)
    assert [(o.text, o.finish_reason) for o in seen] == [("ab", None), ("", "error")]
