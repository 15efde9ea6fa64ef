"""OutputRelay: engine outputs reach each stream's queue in order, a burst in one wake-up."""

from __future__ import annotations

import asyncio
import threading

from eyas.server.choices import OutputRelay, relay_for


def test_a_burst_from_another_thread_arrives_in_order_with_one_wake_up():
    async def scenario() -> tuple[list, list, int]:
        loop = asyncio.get_running_loop()
        relay = OutputRelay(loop)
        wake_ups = 0
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            nonlocal wake_ups
            wake_ups += 1
            return original(callback, *args)

        loop.call_soon_threadsafe = counting
        first, second = asyncio.Queue(), asyncio.Queue()

        def engine_step() -> None:  # one step's outputs for two streams
            for token in range(50):
                relay.send(first if token % 2 == 0 else second, token)

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()  # the loop is blocked here: the whole burst is pending
        got_first = [await asyncio.wait_for(first.get(), 5) for _ in range(25)]
        got_second = [await asyncio.wait_for(second.get(), 5) for _ in range(25)]
        relay.send(first, "later")  # after a delivery, the next send wakes the loop again
        got_first.append(await asyncio.wait_for(first.get(), 5))
        return got_first, got_second, wake_ups

    got_first, got_second, wake_ups = asyncio.run(scenario())
    assert got_first == list(range(0, 50, 2)) + ["later"]
    assert got_second == list(range(1, 50, 2))
    assert wake_ups == 2


def test_one_relay_per_event_loop():
    async def relays() -> tuple[OutputRelay, OutputRelay]:
        loop = asyncio.get_running_loop()
        return relay_for(loop), relay_for(loop)

    a, b = asyncio.run(relays())
    c, _ = asyncio.run(relays())
    assert a is b and c is not a
