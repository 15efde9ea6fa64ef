"""OpenMP worker pools: keep one thread per process doing the parallel work.

Why: PyTorch's CPU wheel runs its parallel regions (and eyas's C++ layers theirs) on GNU
OpenMP, which keeps a pool of worker threads for every thread that ever opened a parallel
region. Once the workers of all pools outnumber the CPUs, libgomp stops letting an idle worker
spin before it sleeps (a few hundred spins instead of 300,000), and each of the hundreds of
small parallel regions of a decode step then waits for a sleeping worker to wake. On the
2-core reference machine, a serving engine that decoded on its own thread after the model had
been loaded on the main thread took 2.6-3.1x as long per token (old BENCHMARKS.md section 7,
"The engine on its own thread").

The serving engine loads nothing itself: the caller loads the model and the engine measures
its costs on the caller's thread, then decodes on its own. `Engine.start` therefore calls
`release_thread_pool()` on the caller's thread first: that thread's idle workers end, and a
later parallel region on it would start them again.

Usage:
    from eyas.utils.openmp import release_thread_pool
    release_thread_pool()   # before handing all parallel work to another thread
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import sys

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep what is cheap to keep


@functools.lru_cache(maxsize=1)
def _pause_function():
    """libgomp's (or LLVM libomp's) omp_pause_resource_all, from the runtime this process
    loaded with torch; None when there is none or it predates OpenMP 5.0."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}  # mapped files
    except OSError:
        return None
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(("libgomp", "libomp", "libiomp")):
            try:
                function = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
            return function
    return None


def release_thread_pool() -> bool:
    """End the calling thread's idle OpenMP workers; True when the runtime did. Call it from
    a thread that will not run parallel work while another thread does."""
    importlib.import_module("torch")  # which loads the OpenMP runtime

    pause = _pause_function()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
