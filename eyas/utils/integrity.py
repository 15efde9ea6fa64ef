"""sha256 manifests: every file eyas writes and later trusts (heads, training checkpoints,
exports) is listed with its size and digest, and checked before it is read.

    manifest.json   {"format": "eyas-manifest", "version": 1,
                     "files": {"model.safetensors": {"bytes": 19732424, "sha256": "9f2c..."}, ...}}

The manifest is written last, atomically, beside the files it lists; a folder written inside
`atomic_dir` (checkpoints, exports) appears with its manifest in one rename. A missing, empty,
truncated or changed file is an `EyasError` that names the file and what is wrong. A folder
without a manifest (written by an eyas from before digests) is read unverified, with a warning.

Usage:
    write_manifest(folder, ["config.json", "model.safetensors"])
    verified = verify_files(folder, ["config.json", "model.safetensors"])  # False: no manifest
    tensors = read_safetensors(folder / "model.safetensors")                # EyasError if unreadable
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from torch import Tensor

from eyas.errors import EyasError
from eyas.utils.io import file_sha256, read_json, write_json_atomic

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "eyas-manifest"
MANIFEST_VERSION = 1

_warned: set[str] = set()  # folders already reported as unverified (one warning per process)


@dataclass(frozen=True)
class FileDigest:
    bytes: int
    sha256: str


def digest_of(path: Path) -> FileDigest:
    return FileDigest(bytes=path.stat().st_size, sha256=file_sha256(path))


def write_manifest(folder: str | Path, names: Iterable[str]) -> dict[str, FileDigest]:
    """Digest the named files of `folder` and write manifest.json atomically (last)."""
    folder = Path(folder)
    digests = {name: digest_of(folder / name) for name in sorted(names)}
    write_json_atomic(folder / MANIFEST_NAME, {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
        "files": {name: {"bytes": d.bytes, "sha256": d.sha256} for name, d in digests.items()},
    })
    return digests


def read_manifest(folder: str | Path) -> dict[str, FileDigest] | None:
    """The digests recorded in `folder`, or None when it has no manifest."""
    path = Path(folder) / MANIFEST_NAME
    if not path.exists():
        return None
    raw = read_json(path)
    try:
        if raw["format"] != MANIFEST_FORMAT or int(raw["version"]) > MANIFEST_VERSION:
            raise EyasError(f"{path} is not an eyas manifest this version reads (format "
                            f"{raw.get('format')!r}, version {raw.get('version')!r})")
        return {name: FileDigest(bytes=int(entry["bytes"]), sha256=str(entry["sha256"]))
                for name, entry in raw["files"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise EyasError(f"{path} is damaged: {type(error).__name__} {error}") from None


def check_file(path: Path, recorded: FileDigest) -> None:
    """Raise EyasError naming `path` unless it has the recorded size and sha256."""
    if not path.is_file():
        raise EyasError(f"{path} is missing ({MANIFEST_NAME} lists it, {recorded.bytes} bytes)")
    size = path.stat().st_size
    if size == 0 and recorded.bytes:
        raise EyasError(f"{path} is empty ({MANIFEST_NAME} records {recorded.bytes} bytes)")
    if size < recorded.bytes:
        raise EyasError(f"{path} is truncated or was changed: {size} bytes, {MANIFEST_NAME} records "
                        f"{recorded.bytes}")
    if size != recorded.bytes:
        raise EyasError(f"{path} has {size} bytes, {MANIFEST_NAME} records {recorded.bytes}: the file "
                        f"changed after eyas wrote it")
    if file_sha256(path) != recorded.sha256:
        raise EyasError(f"{path} is corrupted: its sha256 differs from the one in {MANIFEST_NAME} "
                        f"(the file changed after eyas wrote it)")


def verify_files(folder: str | Path, names: Iterable[str], warn: bool = True) -> bool:
    """Check the named files of `folder` against its manifest; raise EyasError on the first
    fault. Return False (after a one-time warning on stderr) when the folder has no manifest;
    each named file must then at least exist."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        for name in names:
            if not (folder / name).is_file():
                raise EyasError(f"{folder / name} is missing")
        if warn and str(folder) not in _warned:
            _warned.add(str(folder))
            print(f"[eyas] warning: {folder} has no {MANIFEST_NAME} (written by an eyas without "
                  f"file digests): its files are read unverified", file=sys.stderr, flush=True)
        return False
    for name in names:
        if name not in manifest:
            raise EyasError(f"{folder / name} is not listed in {folder / MANIFEST_NAME}")
        check_file(folder / name, manifest[name])
    return True


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a safetensors file; a missing or unreadable file is an EyasError naming it."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise EyasError(f"{path} is missing")
    if path.stat().st_size == 0:
        raise EyasError(f"{path} is empty (0 bytes)")
    try:
        return load_file(str(path))
    except Exception as error:  # SafetensorError, OSError: a truncated or foreign file
        raise EyasError(f"{path} is not a readable safetensors file ({error})") from None
