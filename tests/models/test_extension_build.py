"""Building the C++ extension (models/extension.py) can never leave the cache in a state that
stops a later run: a build killed half-way is recovered from at once, a live one is waited for
a bounded time, and the kept build is whole or absent. The tests build a tiny pybind11 module
(~5 s) with the same NativeBuild that builds eyas's extension."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eyas.models.extension import NativeBuild, eyas_build

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

TINY = """
#include <pybind11/pybind11.h>
static int add(int a, int b) { return a + b; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add, "a + b"); }
"""

# Loads (building if needed) the tiny module from argv[1] (source) into argv[2] (root), prints a + b.
LOADER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from eyas.models.extension import NativeBuild
    build = NativeBuild("eyas_tiny_ext", (Path(sys.argv[1]),), ("-O0",), root=Path(sys.argv[2]))
    print(build.load().add(2, 40))
""")


@pytest.fixture()
def tiny(tmp_path):
    source = tmp_path / "src" / "tiny.cpp"
    source.parent.mkdir()
    source.write_text(TINY)
    return source, tmp_path / "cache"


def run_loader(source: Path, root: Path, env: dict | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-c", LOADER, str(source), str(root)], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


def slow_compiler(tmp_path: Path, marker: Path) -> Path:
    """A c++ wrapper that says when compiling began, then stalls: a build to kill half-way.
    `--version` is passed through, so the build's tag is the plain compiler's."""
    wrapper = tmp_path / "slow-c++"
    wrapper.write_text(f"""#!/bin/sh
case "$1" in --version) exec c++ --version;; esac
touch {marker}
sleep 600
exec c++ "$@"
""")
    wrapper.chmod(0o755)
    return wrapper


def test_a_build_killed_half_way_does_not_stop_the_next_run(tiny, tmp_path):
    source, root = tiny
    marker = tmp_path / "compiling"
    killed = subprocess.Popen([sys.executable, "-c", LOADER, str(source), str(root)],
                              env=dict(os.environ, CXX=str(slow_compiler(tmp_path, marker))),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, "the killed build never reached the compiler"
        time.sleep(0.1)
    os.killpg(killed.pid, signal.SIGKILL)  # as Ctrl-C on ninja, a test timeout or the OOM killer
    killed.wait()
    build = NativeBuild("eyas_tiny_ext", (source,), ("-O0",), root=root)
    assert json.loads(build.lock.read_text())["pid"] == killed.pid  # the dead process's lock is left
    assert list(root.glob("*.build-*"))  # and its half-built private folder

    done = run_loader(source, root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["42"]
    assert f"removing a stale build lock {build.lock}" in done.stderr
    assert "eyas: built the C++ extension in" in done.stderr
    assert build.library.exists() and not build.lock.exists()
    assert not list(root.glob("*.build-*"))  # the killed build's folder is cleaned up

    again = run_loader(source, root)  # the kept build is loaded as it is: no build, no lock
    assert again.returncode == 0 and again.stdout.split() == ["42"]
    assert "building" not in again.stderr


def test_a_live_build_is_waited_for_a_bounded_time(tiny):
    source, root = tiny
    build = NativeBuild("eyas_tiny_ext", (source,), ("-O0",), root=root)
    root.mkdir()
    holder = subprocess.Popen(["sleep", "300"])  # a live process holds the lock and never finishes
    try:
        start = Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        build.lock.write_text(json.dumps({"pid": holder.pid, "start": start}))
        began = time.monotonic()
        done = run_loader(source, root, env={"EYAS_EXT_WAIT": "2"})
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["42"]
        assert f"waiting for process {holder.pid}, which is building" in done.stderr
        assert f"gave up waiting for process {holder.pid}" in done.stderr
        assert time.monotonic() - began < 90
        assert build.lock.exists()  # still the live holder's
        assert not build.library.exists()  # a build made beside a live holder is not kept
    finally:
        holder.kill()
        holder.wait()


def test_two_checkouts_of_the_same_sources_share_one_build_tag(tiny, tmp_path):
    source, root = tiny
    other = tmp_path / "elsewhere" / "tiny.cpp"
    other.parent.mkdir()
    other.write_text(TINY)
    first = NativeBuild("eyas_tiny_ext", (source,), ("-O0",), root=root)
    assert NativeBuild("eyas_tiny_ext", (other,), ("-O0",), root=root).tag == first.tag
    other.write_text(TINY + "// changed\n")
    assert NativeBuild("eyas_tiny_ext", (other,), ("-O0",), root=root).tag != first.tag
    assert NativeBuild("eyas_tiny_ext", (source,), ("-O1",), root=root).tag != first.tag


def test_eyas_build_tag_follows_headers_and_march(monkeypatch):
    native = eyas_build()
    assert {path.name for path in native.headers} >= {"int8dot.h", "simd.h"}
    assert f"-march={os.environ.get('EYAS_EXT_MARCH', 'native')}" in native.cflags
    monkeypatch.setenv("EYAS_EXT_MARCH", "haswell")
    assert eyas_build().tag != native.tag and "-march=haswell" in eyas_build().cflags


def test_bad_wait_limit_is_a_clear_error(monkeypatch):
    from eyas.models.extension import wait_limit

    monkeypatch.setenv("EYAS_EXT_WAIT", "soon")
    with pytest.raises(ValueError, match="EYAS_EXT_WAIT='soon': expected a number of seconds"):
        wait_limit()
