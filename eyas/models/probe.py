"""This machine's limits: read bandwidth, the integer multiply-add peak of the int8 kernels and
the float32 multiply-add peak of attention.

Every floor eyas prints (bench/floors.py) divides a pass's bytes by the read bandwidth, its
integer multiply-adds by the integer peak and attention's float ones by the float peak. All three
are measured by a short probe in the C++ extension (csrc/probe.cpp), at 1 and 2 threads and at
the thread count in use:
- read bandwidth: a buffer much larger than the last-level cache (4x its size, 256 MB to 1 GB)
  streamed 3 times by every thread at once, in steps of 4 MB a thread (each well inside a
  scheduler time slice), the 90th percentile of the steps' rates;
- integer peak: the instruction mix the int8 dot products run (extension.int8dot_kernel():
  vpdpbusd on AVX512-VNNI, vpmaddubsw + vpmaddwd on AVX2) in independent chains shaped as the
  kernels' tiles (weight registers times activations broadcast from memory: chains sharing one
  pair of registers ran at 0.4x the kernels' rate on an AMD Zen 4), best of 16 short runs.
  torch's `_int_mm` says nothing about it (on AVX2 it runs reference loops);
- float peak: fused multiply-adds on the widest registers of the build (512-bit with AVX-512,
  else 256-bit), in independent chains shaped as attention's scores (key registers times
  queries broadcast from memory), best of 16 short runs.
Each is the best of a few such calls (until the two best agree within 3%): on a shared machine
a multi-thread run is slow whenever one thread waits for a core. A busy machine still measures
low limits: figures where 2 threads read or multiply less than 1 thread did are used once and
not cached (a warning says so); others stay cached, and `machine_limits(refresh=True)` (`eyas
bench costs --probe-again`) measures again.

The probe takes ~1-3 s and is cached per machine (CPU model and flags, PyTorch, the
extension's sources, the kernel, the thread counts) as JSON in the eyas cache folder,
written atomically.

Usage:
    from eyas.models.probe import machine_limits
    limits = machine_limits()          # None without the extension or an int8 dot-product kernel
    limits.bandwidth(2), limits.peak(2)  # bytes/s and int8 multiply-adds/s with 2 threads
    limits.float_peak(2)                 # float32 multiply-adds/s with 2 threads
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from eyas.models import extension
from eyas.utils.io import cache_dir, write_json_atomic

PROBE_VERSION = "3"  # part of the cache key: bumped when what the probe measures changes
BANDWIDTH_RUNS, PEAK_RUNS = 3, 16
MIN_BUFFER_MB, MAX_BUFFER_MB = 256, 1024
BUSY_RATIO = 0.9  # more threads below this share of one thread's rate: measured while busy


@dataclass(frozen=True)
class MachineLimits:
    """Measured limits of this machine, per thread count."""

    cpu: str  # the CPU's model name
    kernel: str  # the int8 dot-product implementation measured ("avx512vnni", "avx2")
    buffer_megabytes: int  # the bandwidth probe's buffer
    read_bytes_per_second: dict[int, float]  # threads -> bytes/s
    int8_multiply_adds_per_second: dict[int, float]  # threads -> multiply-adds/s
    float_multiply_adds_per_second: dict[int, float]  # threads -> float32 multiply-adds/s

    def __post_init__(self) -> None:
        for name, table in (("read_bytes_per_second", self.read_bytes_per_second),
                            ("int8_multiply_adds_per_second", self.int8_multiply_adds_per_second),
                            ("float_multiply_adds_per_second", self.float_multiply_adds_per_second)):
            if not table or any(threads < 1 or value <= 0 for threads, value in table.items()):
                raise ValueError(f"{name} needs positive values for thread counts >= 1, got {table}")

    def bandwidth(self, threads: int | None = None) -> float:
        """Read bytes/s with `threads` threads (default: the count in use; the nearest measured)."""
        return _nearest(self.read_bytes_per_second, threads)

    def peak(self, threads: int | None = None) -> float:
        """int8 multiply-adds/s with `threads` threads (default: the count in use)."""
        return _nearest(self.int8_multiply_adds_per_second, threads)

    def float_peak(self, threads: int | None = None) -> float:
        """float32 multiply-adds/s with `threads` threads (default: the count in use)."""
        return _nearest(self.float_multiply_adds_per_second, threads)

    def busy_reason(self) -> str | None:
        """Why these figures look measured on a busy machine (more threads reading or
        multiplying less than one did: a worker waited for a core), or None."""
        for name, table, unit in (("read", self.read_bytes_per_second, "GB/s"),
                                  ("multiply-add", self.int8_multiply_adds_per_second, "G/s"),
                                  ("float multiply-add", self.float_multiply_adds_per_second, "G/s")):
            one = table.get(1)
            for threads, value in sorted(table.items()):
                if one is not None and threads > 1 and value < BUSY_RATIO * one:
                    return (f"{threads} threads measured a {name} rate of {value / 1e9:.1f} {unit} "
                            f"against {one / 1e9:.1f} {unit} on 1")
        return None

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(raw: dict) -> MachineLimits:
        return MachineLimits(raw["cpu"], raw["kernel"], int(raw["buffer_megabytes"]),
                             {int(k): float(v) for k, v in raw["read_bytes_per_second"].items()},
                             {int(k): float(v) for k, v in raw["int8_multiply_adds_per_second"].items()},
                             {int(k): float(v) for k, v in raw["float_multiply_adds_per_second"].items()})


def _nearest(table: dict[int, float], threads: int | None) -> float:
    wanted = torch.get_num_threads() if threads is None else threads
    return table[min(table, key=lambda count: (abs(count - wanted), -count))]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_threads() -> tuple[int, ...]:
    """1 and 2 threads (where the machine has 2 cores) and the count in use."""
    cores = os.cpu_count() or 1
    return tuple(sorted({1, min(2, cores), max(1, torch.get_num_threads())}))


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 (sysfs), 32 MB where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=32 << 20)


def buffer_megabytes() -> int:
    """4x the last-level cache, within 256 MB .. 1 GB (a virtual machine may report the whole
    socket's cache)."""
    return int(min(MAX_BUFFER_MB, max(MIN_BUFFER_MB, 4 * last_level_cache_bytes() >> 20)))


def measure_limits(threads: tuple[int, ...] | None = None, megabytes: int | None = None,
                   kernel: str | None = None) -> MachineLimits:
    """Run the probe now (no cache). Raises RuntimeError where the extension or an int8
    dot-product kernel is missing."""
    loaded = extension.module()
    kernel = kernel or extension.int8dot_kernel()
    if loaded is None or kernel is None:
        raise RuntimeError("the limits probe needs the C++ extension with an int8 dot-product kernel "
                           "(AVX2 or AVX512-VNNI); EYAS_FUSED=0 and EYAS_INT4_KERNEL=torch turn it off")
    threads = threads or probe_threads()
    megabytes = megabytes or buffer_megabytes()
    ops = torch.ops.eyas
    bandwidth = {count: _settled(lambda: ops.probe_read_bandwidth(count, megabytes, BANDWIDTH_RUNS))
                 for count in threads}
    peak = {count: _settled(lambda: ops.probe_int8_peak(kernel, count, PEAK_RUNS)) for count in threads}
    float_peak = {count: _settled(lambda: ops.probe_float_peak(count, PEAK_RUNS)) for count in threads}
    return MachineLimits(cpu_model(), kernel, megabytes, bandwidth, peak, float_peak)


def _settled(measure: Callable[[], float], calls: int = 8, budget_seconds: float = 3.0) -> float:
    """The best of repeated probe calls, stopping once the two best agree within 3%. On a
    shared machine a run of several threads is slow whenever one of them waits for a core;
    every call is already a best of many runs, and a few calls get past a busy stretch."""
    values: list[float] = []
    started = time.monotonic()
    while len(values) < calls:
        values.append(measure())
        best, second = sorted(values, reverse=True)[:2] if len(values) > 1 else (values[0], 0.0)
        if second >= 0.97 * best or time.monotonic() - started > budget_seconds:
            break
    return max(values)


def limits_cache_path() -> Path:
    """Where this machine's limits are kept: the key names the CPU (model and flags), PyTorch,
    the extension's sources, the int8 dot-product kernel and the thread counts."""
    key = "|".join([PROBE_VERSION, cpu_model(), extension.cpu_tag(), torch.__version__,
                    extension.source_tag(), str(extension.int8dot_kernel()),
                    ",".join(map(str, probe_threads()))])
    return cache_dir() / "limits" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def machine_limits(refresh: bool = False) -> MachineLimits | None:
    """This machine's limits, probed once and then read from the cache (`refresh`: probe again
    and replace them); None where the probe cannot run (no extension, no int8 dot-product
    kernel)."""
    if extension.int8dot_kernel() is None:
        return None
    path = limits_cache_path()
    if path.is_file() and not refresh:
        try:
            return MachineLimits.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged file: measure again
    limits = measure_limits()
    busy = limits.busy_reason()
    if busy is not None:  # used this once, never cached: the next command probes again
        print(f"eyas: the machine looked busy while probing its limits ({busy}); they are not "
              "cached and the floors printed may be low", file=sys.stderr)
        return limits
    write_json_atomic(path, limits.to_json())
    return limits
