"""The calling thread's OpenMP workers end before the engine decodes on its own thread
(eyas/utils/openmp.py): two pools on a 2-core machine made every decode step 2.5-3x slower."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from eyas.utils.openmp import release_thread_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or torch.get_num_threads() < 2,
                                reason="counts OpenMP worker threads in /proc (Linux, 2+ threads)")


def threads_named(name: str) -> set[int]:
    """Ids of this process's threads whose name (/proc comm) is `name`."""
    tids = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().rstrip("\n") == name:
                    tids.add(int(tid))
        except OSError:  # the thread ended while we looked
            pass
    return tids


def parallel_work() -> None:
    a = torch.randn(512, 512)
    for _ in range(4):
        a = torch.mm(a, a).clamp_(-1, 1)  # large enough to open a parallel region


def test_releasing_ends_this_threads_workers_and_they_come_back_on_demand():
    # Counts only this thread's pool, not every thread of the process: threads that other
    # tests left behind may start or end meanwhile. The fresh thread takes a name no other
    # thread has, a new Linux thread starts with its creator's name, and libgomp creates a
    # thread's workers from that thread: its workers are the other threads with that name.
    def in_a_fresh_thread(results: list) -> None:
        me = threading.get_native_id()
        name = f"omptest{me}"  # unique while this thread lives; comm holds 15 characters
        with open(f"/proc/self/task/{me}/comm", "w") as comm:
            comm.write(name)

        def pool() -> set[int]:
            return threads_named(name) - {me}

        def pool_once_ended() -> set[int]:
            # libgomp's pause returns once the workers have left the pool; each then calls
            # pthread_exit on its own, so give the kernel a moment to remove them
            deadline = time.monotonic() + 5
            while (left := pool()) and time.monotonic() < deadline:
                time.sleep(0.001)
            return left

        results.append(pool())
        parallel_work()  # this thread's own pool: threads - 1 workers
        results.append(pool())
        results.append(int(release_thread_pool()))
        results.append(pool_once_ended())
        results.append({int(tid) for tid in os.listdir("/proc/self/task")})
        parallel_work()
        results.append(pool())
        release_thread_pool()

    results: list = []
    worker = threading.Thread(target=in_a_fresh_thread, args=(results,))
    worker.start()
    worker.join()
    before, with_pool, released, after, all_after, again = results
    workers = torch.get_num_threads() - 1
    assert released == 1
    assert before == set()
    assert len(with_pool) == workers
    assert after == set()
    assert not with_pool & all_after  # those workers ended, not merely renamed
    assert len(again) == workers


def test_the_engine_releases_the_callers_workers_when_it_starts(tiny_target):
    from eyas.engine.sampling import SamplingParams
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine

    # As above, only the caller's own threads count: the caller takes a unique name, so the
    # other threads with that name are its OpenMP workers and any thread it starts, save a
    # Python thread on 3.14+ (which names the OS thread: "eyas-engine"). The loop's thread
    # is therefore found by its id, not by its name.
    def caller(results: list) -> None:
        me = threading.get_native_id()
        name = f"omptest{me}"
        with open(f"/proc/self/task/{me}/comm", "w") as comm:
            comm.write(name)

        def all_threads() -> set[int]:
            return {int(tid) for tid in os.listdir("/proc/self/task")}

        engine = Engine(tiny_target, EngineConfig(max_running=2))  # allocates on this thread
        parallel_work()
        with_pool = threads_named(name) - {me}
        before_start = all_threads()
        engine.start()  # - this thread's workers, + the loop's thread
        loop = engine._thread.native_id
        deadline = time.monotonic() + 5  # the released workers exit on their own
        while (still := with_pool & all_threads()) and time.monotonic() < deadline:
            time.sleep(0.001)
        # the idle loop has opened no parallel region: no workers of its own yet
        results += [with_pool, still, threads_named(name) - {me, loop} - with_pool,
                    loop in before_start, loop in all_threads()]
        engine.generate([5, 6, 7], SamplingParams(max_tokens=4), 60)
        engine.shutdown()

    results: list = []
    worker = threading.Thread(target=caller, args=(results,))
    worker.start()
    worker.join()
    with_pool, still_alive, other_new, loop_existed, loop_alive = results
    assert len(with_pool) == torch.get_num_threads() - 1  # the caller had its pool
    assert still_alive == set()  # those workers ended (not merely renamed)
    assert not loop_existed and loop_alive  # + the loop's new thread
    assert other_new == set()  # and no other new thread
