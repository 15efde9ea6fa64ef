"""Per-thread CPU seconds by name: a busy named thread is charged under its own name, an idle
one accrues (next to) nothing."""

from __future__ import annotations

import threading
import time

from eyas.utils.thread_cpu import thread_cpu_seconds


def test_a_busy_thread_is_charged_under_its_name():
    spun, release = threading.Event(), threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait()  # alive (listed in /proc) until it has been read

    busy = threading.Thread(target=spin, name="busy-test-thread")
    idle = threading.Thread(target=release.wait, name="idle-test-thread")
    busy.start(), idle.start()
    assert spun.wait(timeout=30)
    seconds = thread_cpu_seconds()
    release.set()
    busy.join(), idle.join()
    assert 0.15 <= seconds["busy-test-thread"] <= 0.5  # 0.2 s of its own clock, 10 ms ticks
    assert seconds["idle-test-thread"] <= 0.02
    assert "MainThread" in seconds
