"""Outputs from the engine thread to the event loop: one wake-up for a burst, not one per output.

Usage:
    relay = OutputRelay.of(asyncio.get_running_loop())
    relay.post(choice_set, (index, output))   # any thread: the engine's output callback
    # on the loop: choice_set.deliver([(index, output), ...]), the burst's items in order

A step of the engine emits one output per running request, one after the other. Waking the
event loop for each (`call_soon_threadsafe`: a write to the loop's self-pipe, a trip through
the selector, a callback) costs the server's thread as much again as streaming the token, and
the engine thread pays the write. Here the first output of a burst schedules one wake-up; the
outputs posted before the loop gets to it join the same delivery.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from typing import Any, Protocol


class Receiver(Protocol):
    def deliver(self, items: list[Any]) -> None: ...


class OutputRelay:
    _relays: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, OutputRelay] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[tuple[Receiver, Any]] = deque()
        self.scheduled = False  # a wake-up is on its way; set by posters, cleared by the loop

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> OutputRelay:
        """The loop's relay (one per event loop)."""
        relay = cls._relays.get(loop)
        if relay is None:
            relay = cls._relays[loop] = cls(loop)
        return relay

    def post(self, receiver: Receiver, item: Any) -> None:
        """From any thread. The item is appended before the flag is read: either the wake-up
        already scheduled finds it, or this call schedules one."""
        self.items.append((receiver, item))
        if not self.scheduled:
            self.scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody is left to read the outputs
                self.scheduled = False

    def _drain(self) -> None:
        """On the loop: every item posted so far, grouped per receiver in posting order."""
        self.scheduled = False  # before popping: an item posted from now on schedules its own
        if len(self.items) == 1:  # the common case at one request: no grouping
            receiver, item = self.items.popleft()
            receiver.deliver([item])
            return
        batches: dict[int, tuple[Receiver, list[Any]]] = {}
        while self.items:
            receiver, item = self.items.popleft()
            batches.setdefault(id(receiver), (receiver, []))[1].append(item)
        for receiver, items in batches.values():
            receiver.deliver(items)
