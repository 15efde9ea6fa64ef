"""The one owner of eyas's C++ extension: how it is built, where it is kept, how it is loaded.

The extension (csrc/: the fused int4 decoder layer, the int4 and int8 x int8 kernels, the output
screen, suffix decoding's trie) is compiled on first use with PyTorch's extension builder (g++,
~1-1.5 min on 2 cores; `make setup` does it ahead of time) and kept in
~/.cache/eyas/ext/<tag>/ (EYAS_EXT_DIR overrides the root). Only the file with the Python
bindings (int4_decoder_layer.cpp) includes <torch/extension.h>; the kernels include
<ATen/ATen.h> (and <torch/library.h> where they register ops): parsing the whole torch API in
each of eight files made the build take twice as long (161 s against 77 s, side by side on the
2-core machine).

A build can never leave the cache in a state that stops a later run:
- The tag names everything that changes the binary: the sources and headers, the compiler
  flags and -march, the compiler, this CPU (a -march=native build is not portable), PyTorch and
  Python. Two checkouts of the same sources share one finished build; nothing in the kept
  folder names a checkout's location.
- Each build runs in a private folder (<tag>.build-<pid>-<random>) and the finished library is
  moved into <tag>/ with one rename, so the kept folder holds a whole build or none. A finished
  build is loaded directly, without the builder, so no lock is taken on the way.
- Only one process builds a tag at a time: it holds <tag>.lock, which records its pid and the
  pid's start time. A lock whose process is gone (killed by Ctrl-C, a test timeout, the OOM
  killer) is broken at once; a live one is waited for at most EYAS_EXT_WAIT seconds (default
  900), with a line on stderr saying which process is awaited, after which this process builds
  on its own in its private folder.
- Starting a build and its duration are said on stderr.

Every other module reaches the extension through this one (`module()`, `int8dot_kernel()`);
nothing here imports another eyas module, so the imports run one way: models -> extension.

Usage:
    python -m eyas.models.extension          # build now (or say why it cannot be built)
    from eyas.models.extension import int8dot_kernel, module
    ext = module()                           # the loaded extension, or None where it cannot be built
    int8dot_kernel()                         # "avx512vnni", "avx2" or None (PyTorch's kernels)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
NAME = "eyas_int4_decoder_layer"  # the Python module name the sources declare (TORCH_EXTENSION_NAME)
SOURCES = ("int4_decoder_layer.cpp", "decoder_layer.cpp", "int4_stack.cpp", "attention.cpp", "int4_gemm.cpp",
           "int8_gemm.cpp", "int8_screen.cpp", "gumbel_screen.cpp", "head_output.cpp", "probe.cpp",
           "suffix_trie.cpp")  # + headers
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")
STALE_BUILD_SECONDS = 3600  # a private build folder whose owner is gone, or older than this, is removed


def march() -> str:
    """The -march the extension is built for: this CPU (native) unless EYAS_EXT_MARCH names
    another (e.g. haswell: an AVX2-only build, to measure what a CPU without AVX-512 runs)."""
    value = os.environ.get("EYAS_EXT_MARCH", "native").strip() or "native"
    if not all(ch.isalnum() or ch in "-_." for ch in value):
        raise ValueError(f"EYAS_EXT_MARCH={value!r}: expected a gcc -march name such as native, haswell")
    return value


def enabled() -> bool:
    """False with EYAS_FUSED=0: every model then runs its Python layers and PyTorch's kernels."""
    return os.environ.get("EYAS_FUSED", "1") != "0"


def wait_limit() -> float:
    """Seconds to wait for another process's build of the same tag (EYAS_EXT_WAIT, default 900)."""
    text = os.environ.get("EYAS_EXT_WAIT", "900").strip() or "900"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"EYAS_EXT_WAIT={text!r}: expected a number of seconds") from None
    if value < 0:
        raise ValueError(f"EYAS_EXT_WAIT={text!r}: expected a number of seconds >= 0")
    return value


def cache_root() -> Path:
    return Path(os.environ.get("EYAS_EXT_DIR", Path.home() / ".cache" / "eyas" / "ext"))


@functools.cache
def cpu_tag() -> str:
    """A short hash of this CPU's model name and flags: -march=native builds are not portable."""
    text = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                text += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return hashlib.sha1(text.encode()).hexdigest()[:10]


@functools.cache
def _compiler_version() -> str:
    compiler = os.environ.get("CXX", "c++")
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
        return result.stdout.splitlines()[0] if result.stdout else compiler
    except (OSError, subprocess.SubprocessError):
        return compiler


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/<pid>/stat), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, start: str | None) -> bool:
    """Whether the process that wrote a lock still runs (same pid and the same start time, so a
    recycled pid does not count)."""
    if pid <= 0:
        return False
    now = _process_start(pid)
    if now is not None:
        return start is None or now == start
    try:  # no /proc (not Linux): ask the kernel
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start is None


@dataclass(frozen=True)
class NativeBuild:
    """One C++ extension: its sources, flags and the folder its finished builds are kept in."""

    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    root: Path = field(default_factory=cache_root)
    headers: tuple[Path, ...] = ()  # hashed into the tag (PyTorch's builder does not track them)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("a native build needs at least one source file")
        if not self.name.isidentifier():
            raise ValueError(f"extension name {self.name!r} must be a Python identifier")

    @functools.cached_property
    def tag(self) -> str:
        """Everything that changes the binary, hashed: sources, headers, flags, compiler, CPU."""
        digest = hashlib.sha1(json.dumps([self.name, list(self.cflags), list(self.ldflags),
                                          _compiler_version()]).encode())
        for path in sorted(self.sources + self.headers, key=lambda p: p.name):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        python = f"py{sys.version_info[0]}{sys.version_info[1]}"
        return f"torch{torch.__version__.replace('+', '_')}-{python}-{cpu_tag()}-{digest.hexdigest()[:10]}"

    @property
    def directory(self) -> Path:
        return self.root / self.tag

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    @property
    def lock(self) -> Path:
        return self.root / f"{self.tag}.lock"

    def load(self, verbose: bool = False):
        """The loaded module: the kept build if there is one, else a new build (see the module
        docstring for how builds of several processes stay out of each other's way)."""
        if self.library.exists():
            return _import(self.name, self.library)
        self.root.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + wait_limit()
        announced = False
        while not self._take_lock():
            if self.library.exists():
                return _import(self.name, self.library)
            holder = _read_lock(self.lock)
            if time.monotonic() >= deadline:
                print(f"eyas: gave up waiting for process {holder.get('pid')} to build the C++ "
                      f"extension in {self.directory}; building it in a private folder",
                      file=sys.stderr, flush=True)
                return self._build(verbose, keep=False)
            if not announced:
                print(f"eyas: waiting for process {holder.get('pid')}, which is building the C++ "
                      f"extension in {self.directory} (at most {wait_limit():.0f} s, EYAS_EXT_WAIT)",
                      file=sys.stderr, flush=True)
                announced = True
            time.sleep(0.5)
        try:
            if self.library.exists():  # finished while we took the lock
                return _import(self.name, self.library)
            return self._build(verbose, keep=True)
        finally:
            self.lock.unlink(missing_ok=True)

    def _take_lock(self) -> bool:
        """Create the lock file (pid and start time); break it first if its process is gone."""
        record = json.dumps({"pid": os.getpid(), "start": _process_start(os.getpid()),
                             "host": platform.node(), "time": time.time()})
        for _ in range(2):
            try:
                descriptor = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_lock(self.lock)
                same_host = holder.get("host") in (None, platform.node())
                if holder and same_host and _alive(int(holder.get("pid", 0)), holder.get("start")):
                    return False
                if not holder and time.time() - _mtime(self.lock) < 5:
                    return False  # being written right now
                print(f"eyas: removing a stale build lock {self.lock} (process "
                      f"{holder.get('pid', '?')} is gone)", file=sys.stderr, flush=True)
                self.lock.unlink(missing_ok=True)
                continue
            with os.fdopen(descriptor, "w") as handle:
                handle.write(record)
            return True
        return False

    def _build(self, verbose: bool, keep: bool):
        """Compile in a private folder; with `keep`, move the library into the kept folder."""
        from torch.utils.cpp_extension import load

        self._remove_stale_builds()
        private = self.root / f"{self.tag}.build-{os.getpid()}-{secrets.token_hex(4)}"
        private.mkdir(parents=True)
        print(f"eyas: building the C++ extension {self.name} (one time per machine and source "
              f"version, ~1-1.5 min) in {self.directory}", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            loaded = load(self.name, sources=[str(path) for path in self.sources],
                          extra_cflags=list(self.cflags), extra_ldflags=list(self.ldflags),
                          build_directory=str(private), verbose=verbose)
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)
            raise
        print(f"eyas: built the C++ extension in {time.monotonic() - started:.1f} s",
              file=sys.stderr, flush=True)
        if keep:
            finished = private.with_name(private.name + ".done")
            finished.mkdir()
            os.replace(private / f"{self.name}.so", finished / f"{self.name}.so")
            info = {"name": self.name, "sources": [p.name for p in self.sources], "cflags": list(self.cflags),
                    "compiler": _compiler_version(), "seconds": round(time.monotonic() - started, 1)}
            (finished / "build.json").write_text(json.dumps(info, indent=1) + "\n")
            try:
                os.rename(finished, self.directory)  # atomic: the kept folder is whole or absent
            except OSError:  # another process kept its build first (identical bits): drop ours
                shutil.rmtree(finished, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)
        return loaded

    def _remove_stale_builds(self) -> None:
        """Private folders left by builds that were killed half-way."""
        for path in self.root.glob(f"{self.tag}.build-*"):
            try:
                pid = int(path.name.split(".build-", 1)[1].split("-")[0])
            except (IndexError, ValueError):
                continue
            if pid != os.getpid() and (not _alive(pid, None) or time.time() - _mtime(path) > STALE_BUILD_SECONDS):
                shutil.rmtree(path, ignore_errors=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _read_lock(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _import(name: str, library: Path):
    """Load a finished build's library as the Python module `name` (torch is imported first)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, library)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    sys.modules[name] = loaded
    return loaded


def eyas_build() -> NativeBuild:
    """The build of eyas's extension for the current EYAS_EXT_MARCH and EYAS_EXT_DIR."""
    return _eyas_build(march(), cache_root())


@functools.cache
def _eyas_build(arch: str, root: Path) -> NativeBuild:  # the sources are hashed once per process
    headers = tuple(sorted(CSRC.glob("*.h")))
    return NativeBuild(NAME, tuple(CSRC / name for name in SOURCES), CFLAGS + (f"-march={arch}",),
                       ("-fopenmp",), root, headers)


def source_tag() -> str:
    """A short hash of the sources, headers and flags (part of the measured costs' cache key)."""
    return eyas_build().tag.rsplit("-", 1)[1][:8]


def build_directory() -> Path:
    return eyas_build().directory


_module = None  # the loaded module, False after a failed build, None before trying


def module(verbose: bool = False):
    """The compiled extension, building it on first use; None where it cannot be built. The
    first load also applies EYAS_INT4_KERNEL's choice of int8 dot-product kernel."""
    global _module
    if _module is None:
        try:
            _module = eyas_build().load(verbose=verbose)
        except Exception as error:  # no compiler, no headers, ...: the Python layers still work
            warnings.warn(f"eyas: the C++ extension could not be built ({error}); decoding uses "
                          "the Python layers (slower)", RuntimeWarning, stacklevel=2)
            _module = False
        else:
            int8dot_kernel()  # EYAS_INT4_KERNEL's choice, from the first use on
            int4_activation_bits()  # and EYAS_INT4_ACTIVATIONS's
            screen_activation_bits()  # and EYAS_SCREEN_ACTIVATIONS's
            pool_split()  # and EYAS_POOL_SPLIT's
            int4_prefetch()  # and EYAS_INT4_PREFETCH's
            int4_amx()  # and EYAS_INT4_AMX's
    return _module or None


INT4_KERNELS = ("auto", "avx512vnni", "avx2", "torch")


def int8dot_kernel() -> str | None:
    """Which implementation of the extension's integer dot products runs int4 weights
    (csrc/int4_gemm.cpp) and the output layer's screen (csrc/int8_screen.cpp): "avx512vnni",
    "avx2", or None for PyTorch's kernels (no extension, EYAS_FUSED=0, a CPU without AVX2).

    EYAS_INT4_KERNEL chooses: auto (the default: the best this CPU has), avx512vnni, avx2 (the
    same bits, slower; what a CPU without AVX-512 runs), or torch (PyTorch's int4 kernel, for
    comparisons). It is read when int4 weights are packed, so set it before loading a model.
    """
    choice = os.environ.get("EYAS_INT4_KERNEL", "auto").strip().lower() or "auto"
    if choice not in INT4_KERNELS:
        raise ValueError(f"EYAS_INT4_KERNEL={choice!r}: accepted values are {', '.join(INT4_KERNELS)}")
    loaded = module() if enabled() and choice != "torch" else None
    if loaded is None or not loaded.int8dot_kernels():
        return None
    built = list(loaded.int8dot_kernels())
    if choice == "auto":
        choice = built[0]
    elif choice not in built:
        raise ValueError(f"EYAS_INT4_KERNEL={choice}: this CPU's build of the extension has "
                         f"{', '.join(built)}; use one of those, auto or torch")
    if loaded.int8dot_kernel() != choice:
        loaded.set_int8dot_kernel(choice)
    return choice


def main() -> int:
    """Build the extension now (make setup runs this) and say where it is, or why not."""
    loaded = module(verbose="-v" in sys.argv[1:])
    if loaded is None:
        print("eyas: C++ extension not built; decoding will use the Python layers", file=sys.stderr)
        return 0  # not an install failure: the fallback works
    print(f"eyas: C++ extension ready in {build_directory()}")
    return 0


def _setting(variable: str, accepted: tuple[str, ...], lower: bool = False) -> str:
    """The value of the environment variable `variable`, one of `accepted` (the first where it is
    unset or empty); anything else is an error that names the accepted values."""
    text = os.environ.get(variable, accepted[0]).strip()
    choice = (text.lower() if lower else text) or accepted[0]
    if choice not in accepted:
        raise ValueError(f"{variable}={choice!r}: accepted values are {', '.join(accepted)}")
    return choice


def _apply(getter: str, setter: str, value) -> None:
    """Set the loaded extension's setting (`getter` / `setter`, its bindings) to `value` where it
    differs; nothing where the extension is off or cannot be built."""
    loaded = module() if enabled() else None
    if loaded is not None and getattr(loaded, getter)() != value:
        getattr(loaded, setter)(value)


INT4_ACTIVATIONS = ("14", "8")


def int4_activation_bits() -> int:
    """How the int4 kernel (csrc/int4_gemm.cpp) rounds activations: 14 bits (the default: two
    int8 parts per input, top-1 agreement with float32 as PyTorch's kernel) or 8 bits (one
    int8 part: half the integer work of each extra row, lower agreement), from
    EYAS_INT4_ACTIVATIONS. Every pass of a process uses the same, so speculation stays lossless
    with either."""
    bits = int(_setting("EYAS_INT4_ACTIVATIONS", INT4_ACTIVATIONS))
    _apply("int4_activation_bits", "set_int4_activation_bits", bits)
    return bits


SCREEN_ACTIVATIONS = ("8", "14")


def screen_activation_bits() -> int:
    """How the output layer's int8 screen (csrc/int8_screen.cpp) rounds activations: 8 bits
    (the default: one int8 pass per row, a power-of-two step per group of 32 inputs) or 14
    bits (two passes, one scale per row: a tighter bound, so fewer candidates re-checked in
    float32), from EYAS_SCREEN_ACTIVATIONS. The argmax is exact with either."""
    bits = int(_setting("EYAS_SCREEN_ACTIVATIONS", SCREEN_ACTIVATIONS))
    _apply("screen_activation_bits", "set_screen_activation_bits", bits)
    return bits


POOL_SPLITS = ("segments", "chunks")


def pool_split() -> str:
    """How the extension's worker pool (csrc/worker_pool.h) hands out a parallel region, from
    EYAS_POOL_SPLIT: segments (the default: one contiguous segment per thread, then stealing from
    the others' ends) or chunks (chunks in turn from one counter, kept for comparisons). The
    values are the same bits with either; only the time changes."""
    choice = _setting("EYAS_POOL_SPLIT", POOL_SPLITS, lower=True)
    _apply("pool_split", "set_pool_split", choice)
    return choice


INT4_PREFETCHES = ("stream", "blocks")


def int4_prefetch() -> str:
    """How the int4 and int8 weight kernels (csrc/int4_gemm.cpp, csrc/int8_gemm.cpp) prefetch
    their weights, from EYAS_INT4_PREFETCH: stream (the default: each group's cache lines 2 KB
    ahead in a thread's stream of blocks) or blocks (whole blocks of columns 4 ahead, in bursts:
    what ran before, kept for CPUs where it measures faster). The values are the same bits with
    either; only the time changes (BENCHMARKS.md, "Kernels and precisions", says how to compare)."""
    choice = _setting("EYAS_INT4_PREFETCH", INT4_PREFETCHES, lower=True)
    _apply("int4_prefetch", "set_int4_prefetch", choice)
    return choice


INT4_AMX = ("auto", "off")


def int4_amx() -> bool:
    """Whether the int4 kernel (csrc/int4_gemm.cpp) multiplies whole tiles of 16 rows with Intel
    AMX, from EYAS_INT4_AMX: auto (the default: where the CPU, this build and Linux allow it) or
    off (vpdpbusd for every row). The values are the same bits either way; AMX is faster from 16
    rows on (prefill chunks, wide batches), and the one-token step and small drafts never use it."""
    choice = _setting("EYAS_INT4_AMX", INT4_AMX, lower=True)
    loaded = module() if enabled() else None
    if loaded is None:
        return False
    _apply("int4_amx", "set_int4_amx", choice == "auto" and loaded.int4_amx_available())
    return bool(loaded.int4_amx())


if __name__ == "__main__":
    raise SystemExit(main())
