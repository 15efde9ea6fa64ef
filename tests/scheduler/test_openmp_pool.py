"""The calling thread's OpenMP workers end before the engine decodes on its own thread
(eyas/utils/openmp.py): two pools on a 2-core machine made every decode step 2.5-3x slower."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from eyas.utils.openmp import release_thread_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or torch.get_num_threads() < 2,
                                reason="counts OpenMP worker threads in /proc (Linux, 2+ threads)")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_work() -> None:
    a = torch.randn(512, 512)
    for _ in range(4):
        a = torch.mm(a, a).clamp_(-1, 1)  # large enough to open a parallel region


def test_releasing_ends_this_threads_workers_and_they_come_back_on_demand():
    def in_a_fresh_thread(results: list[int]) -> None:
        results.append(os_threads())
        parallel_work()  # this thread's own pool: threads - 1 workers
        results.append(os_threads())
        results.append(int(release_thread_pool()))
        results.append(os_threads())
        parallel_work()
        results.append(os_threads())
        release_thread_pool()

    results: list[int] = []
    worker = threading.Thread(target=in_a_fresh_thread, args=(results,))
    worker.start()
    worker.join()
    before, with_pool, released, after, again = results
    workers = torch.get_num_threads() - 1
    assert released == 1
    assert with_pool == before + workers
    assert after == before
    assert again == with_pool


def test_the_engine_releases_the_callers_workers_when_it_starts(tiny_target):
    from eyas.engine.sampling import SamplingParams
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine

    def caller(results: list[int]) -> None:
        engine = Engine(tiny_target, EngineConfig(max_running=2))  # allocates on this thread
        parallel_work()
        results.append(os_threads())
        engine.start()  # + the loop's thread, - this thread's workers
        results.append(os_threads())
        engine.generate([5, 6, 7], SamplingParams(max_tokens=4), 60)
        engine.shutdown()

    results: list[int] = []
    worker = threading.Thread(target=caller, args=(results,))
    worker.start()
    worker.join()
    with_pool, started = results
    assert started == with_pool + 1 - (torch.get_num_threads() - 1)
