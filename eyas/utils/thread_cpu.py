"""CPU seconds of each thread of this process, by thread name (Linux: /proc/self/task).

What the benchmark scripts use to split a run's CPU between the engine thread, its OpenMP
workers (threads Python did not start, so without a name of their own), the HTTP event loop and
the rest.

Usage:
    before = thread_cpu_seconds()
    ...
    after = thread_cpu_seconds()
    spent = {name: after[name] - before.get(name, 0.0) for name in after}
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path


def thread_cpu_seconds(unnamed: str = "openmp") -> dict[str, float]:
    """CPU seconds (user + system) of each thread, summed by thread name; threads that Python
    did not start (OpenMP workers) are summed under `unnamed`."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = defaultdict(float)
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = names.get(int(task.name), unnamed)
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended while being read
            continue
        seconds[name] += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return seconds
