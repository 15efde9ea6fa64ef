"""A GGUF file's header, read fast: its metadata and its tensor table, nothing else.

Why not gguf.GGUFReader: it builds a numpy view for every element of every metadata array, and a
tokenizer's vocabulary and merges are hundreds of thousands of strings: ~10-25 s for a 1.5B
Qwen GGUF on the 2-core machine, on every load. Here the header is walked with `struct` over a
memory map; arrays are skipped (their strings' lengths read, nothing built) unless their key is
asked for. Tensor data stays in the map: `GGUFTensor.data` is a numpy view of its bytes, shaped
as gguf.GGUFReader shapes it (so gguf.quants' block formulas apply unchanged).

Usage:
    header = read_gguf_header("model.gguf")
    header.metadata["general.architecture"]            # "qwen2"
    tensor = header.tensors["token_embd.weight"]        # GGUFTensor: type, shape, offset
    blocks = tensor.data                                # numpy view into the map (no copy)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eyas.errors import EyasError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: id -> (struct format, size); 8 = string, 9 = array
SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
STRING, ARRAY = 8, 9
# numpy types of the unquantized tensor types gguf.GGUFReader views as elements (others: bytes)
ELEMENT_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                 27: np.int64, 28: np.float64}


@dataclass
class GGUFTensor:
    name: str
    type_id: int  # gguf.GGMLQuantizationType value
    dims: tuple[int, ...]  # GGUF order (innermost first), as gguf.GGUFReader's `shape`
    data_offset: int  # absolute, in the file
    n_bytes: int
    buffer: mmap.mmap

    @property
    def tensor_type(self):
        import gguf

        return gguf.GGMLQuantizationType(self.type_id)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims)) if self.dims else 1

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes as gguf.GGUFReader gives them: elements for F32/F16/integers
        ([rows, columns] in numpy order), else uint8 [rows, bytes per row]."""
        np_dims = tuple(reversed(self.dims))
        if self.type_id in ELEMENT_TYPES:
            dtype = ELEMENT_TYPES[self.type_id]
            return np.frombuffer(self.buffer, dtype=dtype, count=self.n_elements,
                                 offset=self.data_offset).reshape(np_dims)
        raw = np.frombuffer(self.buffer, dtype=np.uint8, count=self.n_bytes, offset=self.data_offset)
        return raw.reshape(*np_dims[:-1], -1) if np_dims else raw


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]  # scalars and strings; arrays only where asked for
    tensors: dict[str, GGUFTensor]  # in file order
    buffer: mmap.mmap  # the file, mapped read-only


class _Cursor:
    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer, self.offset, self.path = buffer, 0, path

    def unpack(self, fmt: str, size: int) -> Any:
        if self.offset + size > len(self.buffer):
            raise EyasError(f"{self.path} is not a readable GGUF file (its header is truncated "
                            f"at byte {self.offset})")
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.unpack("<Q", 8)
        end = self.offset + length
        if end > len(self.buffer):
            raise EyasError(f"{self.path} is not a readable GGUF file (a string runs past its end)")
        text = self.buffer[self.offset:end].decode("utf-8", errors="replace")
        self.offset = end
        return text

    def value(self, type_id: int, keep_arrays: bool) -> Any:
        if type_id in SCALARS:
            return self.unpack(*SCALARS[type_id])
        if type_id == STRING:
            return self.string()
        if type_id == ARRAY:
            item_type, count = self.unpack("<I", 4), self.unpack("<Q", 8)
            if keep_arrays:
                return [self.value(item_type, True) for _ in range(count)]
            if item_type in SCALARS:
                self.offset += count * SCALARS[item_type][1]
            elif item_type == STRING:
                buffer, offset = self.buffer, self.offset
                for _ in range(count):
                    (length,) = struct.unpack_from("<Q", buffer, offset)
                    offset += 8 + length
                self.offset = offset
            else:
                for _ in range(count):
                    self.value(item_type, False)
            if self.offset > len(self.buffer):
                raise EyasError(f"{self.path} is not a readable GGUF file (an array runs past its end)")
            return None
        raise EyasError(f"{self.path} is not a readable GGUF file (unknown metadata type {type_id} "
                        f"at byte {self.offset})")


def read_gguf_header(path: str | Path, arrays: tuple[str, ...] = ()) -> GGUFHeader:
    """The header of a GGUF file (version 2 or 3). Metadata arrays are skipped unless their key
    is in `arrays`. Raises EyasError on anything that is not a well-formed GGUF."""
    import gguf

    path = Path(path)
    try:
        with open(path, "rb") as handle:
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as error:  # ValueError: an empty file cannot be mapped
        raise EyasError(f"{path} is not a readable GGUF file ({error})") from None
    cursor = _Cursor(buffer, path)
    if len(buffer) < 24 or buffer[:4] != MAGIC:
        raise EyasError(f"{path} is not a GGUF file (no 'GGUF' magic at its start)")
    cursor.offset = 4
    version = cursor.unpack("<I", 4)
    if version not in (2, 3):
        raise EyasError(f"{path} is GGUF version {version}; eyas reads versions 2 and 3")
    tensor_count, kv_count = cursor.unpack("<Q", 8), cursor.unpack("<Q", 8)
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        type_id = cursor.unpack("<I", 4)
        value = cursor.value(type_id, keep_arrays=key in arrays)
        if value is not None:
            metadata[key] = value
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        n_dims = cursor.unpack("<I", 4)
        dims = tuple(cursor.unpack("<Q", 8) for _ in range(n_dims))
        type_id, offset = cursor.unpack("<I", 4), cursor.unpack("<Q", 8)
        infos.append((name, dims, type_id, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.offset // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_id, offset in infos:
        elements = int(np.prod(dims)) if dims else 1
        try:
            block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise EyasError(f"{path}: tensor {name} has unknown GGUF type {type_id}") from None
        n_bytes = elements // block_size * type_size
        start = data_start + offset
        if start + n_bytes > len(buffer):
            raise EyasError(f"{path} is truncated: tensor {name} ends at byte {start + n_bytes}, "
                            f"the file has {len(buffer)}")
        tensors[name] = GGUFTensor(name, type_id, dims, start, n_bytes, buffer)
    return GGUFHeader(path, version, metadata, tensors, buffer)
