"""Split embedded models: parts joined in numeric order and checked against their sha256."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from eyas.errors import EyasError
from eyas.models import parts as parts_module
from eyas.models.parts import extract_parts, join_parts, ordered_parts
from eyas.models.registry import ALIASES, EmbeddedModel, resolve_model


def write_parts(folder: Path, count: int) -> tuple[list[Path], bytes]:
    """`count` parts named as the packages name them (part01.bin ... part12.bin)."""
    folder.mkdir(parents=True, exist_ok=True)
    pieces = [bytes([i]) * (1000 + 37 * i) for i in range(1, count + 1)]
    paths = []
    for i, piece in enumerate(pieces, start=1):
        path = folder / f"part{i:02d}.bin"
        path.write_bytes(piece)
        paths.append(path)
    return paths, b"".join(pieces)


def test_parts_are_joined_in_numeric_order_and_verified(tmp_path):
    paths, whole = write_parts(tmp_path / "parts", 12)
    shuffled = paths[::-1]
    assert [p.name for p in ordered_parts(shuffled, 12)][8:11] == ["part09.bin", "part10.bin", "part11.bin"]
    out = join_parts(ordered_parts(shuffled, 12), tmp_path / "model.gguf", hashlib.sha256(whole).hexdigest())
    assert out.read_bytes() == whole


def test_a_wrong_digest_leaves_no_file_and_says_why(tmp_path):
    paths, whole = write_parts(tmp_path / "parts", 3)
    with pytest.raises(EyasError, match="sha256"):
        join_parts(paths[::-1], tmp_path / "model.gguf", hashlib.sha256(whole).hexdigest())  # wrong order
    assert not (tmp_path / "model.gguf").exists()
    assert list(tmp_path.glob(".model.gguf*")) == []


def test_missing_or_repeated_parts_are_named(tmp_path):
    paths, _ = write_parts(tmp_path / "parts", 4)
    with pytest.raises(EyasError, match=r"missing \[3\]"):
        ordered_parts([paths[0], paths[1], paths[3]], 4)
    with pytest.raises(EyasError, match="twice"):
        ordered_parts([*paths, paths[2]], 4)


def test_fetch_from_wheels_joins_the_data_files_into_the_cache(tmp_path, monkeypatch):
    """A split alias from already-downloaded wheels (no network): each wheel's data/partNN.bin,
    in the packages' order, into the cache, where the alias then resolves."""
    paths, whole = write_parts(tmp_path / "parts", 3)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, path in enumerate(paths, start=1):
        with zipfile.ZipFile(wheels / f"toy_model_part{i}-0.1-py3-none-any.whl", "w") as archive:
            archive.writestr(f"toy_model_part{i}/__init__.py", "")
            archive.write(path, f"toy_model_part{i}/data/{path.name}")
    entry = EmbeddedModel(package="", pip_name="toy-model-part{index}==0.1", filename="toy.gguf",
                          description="toy", hf_id="toy/toy", torch_dtype="float32", parts=3,
                          sha256=hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(ALIASES, "toy", entry)
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(EyasError, match="make qwen"):
        resolve_model("toy")  # not fetched yet: says how
    out = parts_module.fetch("toy", wheels_dir=wheels)
    assert out == tmp_path / "cache" / "models" / "embedded" / "toy.gguf"
    assert out.read_bytes() == whole
    assert len(extract_parts(sorted(wheels.glob("*.whl")), tmp_path / "x")) == 3


def test_the_qwen_aliases_name_their_parts_and_digests():
    for name, count in (("qwen2.5-coder-0.5b", 6), ("qwen2.5-coder-1.5b", 22)):
        entry = ALIASES[name]
        assert entry.parts == count and len(entry.sha256) == 64
        assert entry.pip_name.format(index=count).endswith(f"part{count}==" + entry.pip_name.split("==")[1])
