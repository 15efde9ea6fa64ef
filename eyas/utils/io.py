"""Atomic file writes and the eyas cache folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def _default_mode() -> int:
    """0o666 less the process umask: what a plain open() would create."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def cache_dir() -> Path:
    """The eyas cache folder: $EYAS_CACHE, else $XDG_CACHE_HOME/eyas, else ~/.cache/eyas."""
    if os.environ.get("EYAS_CACHE"):
        return Path(os.environ["EYAS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "eyas"


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success rename it over `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _default_mode())  # mkstemp makes 0600 files; others may need to read them
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_json(path: str | Path) -> Any:
    """The JSON value in `path`; a missing file or one that does not parse raises EyasError
    naming it."""
    from eyas.errors import EyasError

    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise EyasError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        reason = "it is empty" if Path(path).stat().st_size == 0 else str(error)
        raise EyasError(f"{path} is not valid JSON: {reason}") from None


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write `obj` as indented JSON to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; on success rename it to `path` atomically.

    If `path` appears meanwhile (another process won the race), the temporary folder is dropped.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
