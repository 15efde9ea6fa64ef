"""The int4 model cache: packed int4 weights, written once, memory-mapped on every later load
(int8 models are cached the same way, under int8/, with the key naming their weights).

Quantizing a model costs a pass over its float weights (seconds for a 1.5B GGUF); the result
depends only on the source file and on how Int4Linear packs (its layout, the extension's
sources, PyTorch's version). So the decoder's tensors after quantization (int4 codes with their
scales and minimums in the kernel's layout, norms, biases) are kept as one safetensors file:

    <cache>/int4/<source name>-<key>/model.safetensors   the decoder layers + final norm
                                    /manifest.json       its size and sha256 (utils/integrity.py)
                                    /verified.json       the file's inode, size and times when
                                                         its sha256 last matched

keyed by the source files (path, size, modification time) and the packing format. The token
embedding and an untied output layer are not in it: they are used as the source holds them and
read from the source (memory-mapped) on each load, so the cache is the int4 part alone. No float
copy of a weight is written. The file is written tensor by tensor (no second copy in memory) and
read back memory-mapped: loading maps it, checks its digest and builds no tensor of its own.
The digest is checked on the first load and again whenever the file's inode, size or times
differ from those recorded when it last matched (verified.json), not on every load: hashing a
1 GB cache would cost ~1 s of each.

A cache whose digest, size or header does not check out is rebuilt from the source, with one
line on stderr saying why. A new key (the source file changed, or the extension's sources, or
PyTorch) makes a new folder; so that these do not pile up, each save keeps the KEEP most
recently used folders of the same source name and removes the others (a load marks its folder
used).

Usage:
    cache = Int4Cache.for_source(source.files(), name="qwen2.5-coder-1.5b", group_size=32)
    tensors = cache.load()            # None: absent or damaged (said on stderr); else name -> tensor
    cache.save(model_tensors, {"source": "..."})
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from eyas.errors import EyasError
from eyas.utils.integrity import read_manifest, verify_files, write_manifest
from eyas.utils.io import atomic_dir, cache_dir, read_json, write_json_atomic

CACHE_VERSION = 2  # bump when what the cache holds changes (2: the output screen of an untied GGUF)
FILE = "model.safetensors"
STAMP = "verified.json"  # the file's state when its digest last matched (skips re-hashing)
DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64"}
SAFETENSORS_DTYPES = {code: dtype for dtype, code in DTYPES.items()}
ALIGN = 64  # every tensor's data starts at a multiple of this (any dtype view is aligned)
KEEP = 2  # cache folders kept per source name (the newest, by last use)


def packing_format(group_size: int, weights: str = "int4") -> dict[str, str | int]:
    """What decides the bytes Int4Linear (or Int8Linear, `weights` "int8") holds: its layout,
    the extension's sources (they pack the int8dot and int8 layouts), PyTorch's version (it
    packs the torch layout)."""
    from eyas.models.extension import int8dot_kernel, source_tag

    kernel = int8dot_kernel()
    layout = "int8dot" if kernel is not None else "torch"
    packing: dict[str, str | int] = {"version": CACHE_VERSION, "group_size": group_size, "layout": layout,
                                     "extension": source_tag() if kernel is not None else "",
                                     "torch": torch.__version__}
    if weights != "int4":  # int4's keys stay those of the caches already written
        packing["weights"] = weights
    return packing


def source_key(files: list[Path]) -> str:
    parts = []
    for path in files:
        stat = path.stat()
        parts.append(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}")
    return "\n".join(parts)


@dataclass(frozen=True)
class Int4Cache:
    folder: Path
    source: str  # what the folder was made from, for messages
    name: str = ""  # the source name (folders of other keys are '<name>-<key>' beside it)
    weights: str = "int4"  # what the cache holds: int4 or int8 decoder layers

    @classmethod
    def for_source(cls, files: list[Path], name: str, group_size: int,
                   root: Path | None = None, weights: str = "int4") -> Int4Cache:
        """The cache of `weights` (int4 or int8) for these source files, under `root`
        (default: the eyas cache's int4/ or int8/ folder)."""
        if weights not in ("int4", "int8"):
            raise ValueError(f"quantized weights are int4 or int8, not {weights!r}")
        key_text = source_key(files) + "\n" + json.dumps(packing_format(group_size, weights), sort_keys=True)
        key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
        root = root if root is not None else cache_dir() / weights
        name = name if weights == "int4" else f"{name}-{weights}"  # apart from int4's, in any root
        return cls(folder=root / f"{name}-{key}", source=", ".join(str(f) for f in files), name=name,
                   weights=weights)

    def load(self) -> dict[str, Tensor] | None:
        """The cached tensors, memory-mapped; None when there is no cache or it is damaged
        (then said on stderr: the caller rebuilds it). A folder without its manifest is an
        interrupted write, also rebuilt."""
        if not (self.folder / "manifest.json").is_file():
            return None
        try:
            if not self._stamp_matches():
                verify_files(self.folder, [FILE])
                self._write_stamp()
            tensors = read_mapped(self.folder / FILE)
            self.folder.touch()  # last used: what `prune` keeps
            return tensors
        except EyasError as error:
            print(f"[eyas] the {self.weights} cache {self.folder} is damaged ({error}); rebuilding it from "
                  f"{self.source}", file=sys.stderr, flush=True)
            return None

    def _file_state(self) -> dict[str, int | str]:
        """What the stamp compares: the file's identity and times, and the digest it was
        checked against."""
        stat = (self.folder / FILE).stat()
        manifest = read_manifest(self.folder) or {}
        digest = manifest.get(FILE)
        return {"bytes": stat.st_size, "inode": stat.st_ino, "mtime_ns": stat.st_mtime_ns,
                "ctime_ns": stat.st_ctime_ns, "sha256": digest.sha256 if digest else ""}

    def _stamp_matches(self) -> bool:
        """True when the file was hashed and matched its manifest before and has not been
        touched since (same inode, size, modification and change times): hashing a 1 GB cache
        costs ~1 s of every load, and any write to the file changes its times."""
        stamp = self.folder / STAMP
        if not stamp.is_file():
            return False
        try:
            return read_json(stamp) == self._file_state()
        except (EyasError, OSError, ValueError):
            return False

    def _write_stamp(self) -> None:
        try:
            write_json_atomic(self.folder / STAMP, self._file_state())
        except OSError:  # a read-only cache: verified on every load instead
            pass

    def save(self, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
        """Write the tensors and their manifest; the folder appears whole (one rename)."""
        import shutil

        if self.folder.exists():
            shutil.rmtree(self.folder)  # a damaged cache: replaced
        with atomic_dir(self.folder) as tmp:
            write_streaming(tmp / FILE, tensors, metadata)
            write_manifest(tmp, [FILE])
        self.prune()

    def prune(self, keep: int = KEEP) -> list[Path]:
        """Remove all but the `keep` most recently used folders of this source name (this one
        always stays). Returns the removed folders. A process still mapping a removed file keeps
        its pages (the file lives on until unmapped)."""
        import shutil

        if not self.name:
            return []
        prefix = f"{self.name}-"
        others = [path for path in self.folder.parent.glob(f"{prefix}*")
                  if path.is_dir() and path != self.folder
                  and len(path.name) == len(prefix) + 16 and (path / "manifest.json").is_file()]
        others.sort(key=lambda path: path.stat().st_mtime, reverse=True)
        removed = others[max(keep - 1, 0):]
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed


def write_streaming(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file, written tensor by tensor (safetensors' save_file first copies every
    tensor to bytes: a second model in memory). Offsets are padded to ALIGN bytes."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} is not written to the int4 cache")
        start = -(-offset // ALIGN) * ALIGN
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [start, start + size]}
        offset = start + size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % ALIGN)  # data starts aligned in the file as well
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)))
        handle.write(text)
        base = handle.tell()
        for name, tensor in tensors.items():
            start = header[name]["data_offsets"][0]
            handle.write(b"\0" * (base + start - handle.tell()))
            flat = tensor.detach().contiguous().cpu().reshape(-1)
            handle.write(memoryview(flat.view(torch.uint8).numpy()))


def read_header(path: Path) -> tuple[int, dict]:
    """(where the data starts, the JSON header) of a safetensors file."""
    with open(path, "rb") as handle:
        try:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > path.stat().st_size:
                raise ValueError(f"header length {length} exceeds the file")
            return 8 + length, json.loads(handle.read(length))
        except (struct.error, ValueError, UnicodeDecodeError) as error:
            raise EyasError(f"{path} has no readable safetensors header ({error})") from None


def read_tensor(path: Path, base: int, entry: dict) -> Tensor:
    """One tensor of a safetensors file (header `entry`), read into memory of its own."""
    start, end = entry["data_offsets"]
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    out = torch.empty(end - start, dtype=torch.uint8)
    with open(path, "rb") as handle:
        handle.seek(base + start)
        if handle.readinto(memoryview(out.numpy())) != end - start:
            raise EyasError(f"{path} is truncated (tensor at bytes {base + start}..{base + end})")
    return out.view(dtype).reshape(entry["shape"])


def read_mapped(path: Path) -> dict[str, Tensor]:
    """The tensors of a safetensors file as views of one private memory map of it (pages are
    read on first touch and shared with the page cache; writes would stay private)."""
    base, header = read_header(path)
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    tensors: dict[str, Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        if base + end > len(mapped):
            raise EyasError(f"{path} is truncated ({name} ends past the end of the file)")
        if end == start:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=end - start, offset=base + start)
        tensors[name] = raw.view(dtype).reshape(entry["shape"])
    return tensors


