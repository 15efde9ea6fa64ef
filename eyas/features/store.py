"""The offline feature store: sharded safetensors plus an index with shapes and checksums.

Layout of a store folder:

    index.json                 format, target, layer ids (boundary), dtype, and per shard: file,
                               sha256, bytes, tensor shapes, sample ids and lengths
    shard-00000.safetensors    tensors packed over the shard's samples (N = its token count):
                                 input_ids int32 [N]   loss_mask uint8 [N]   offsets int64 [n + 1]
                                 taps      dtype [N, 3H]  residual entering each tap layer
                                 hidden    dtype [N, H]   last hidden state after the final norm
    shard-00000.json           that shard's index entry (its presence marks the shard complete)
    extraction.json            the settings that made the store (a resumed run must match them)

Sample j of a shard occupies rows offsets[j]:offsets[j+1]. Every shard's size, sha256 and tensor
header are checked the first time the shard is read (`shard_problem`); a bad shard raises an
`EyasError` that names it and what is wrong. `eyas features` checks the shards already on disk
the same way before it skips them, and rebuilds a bad one.

Usage:
    entry = write_shard(folder, 0, samples, torch.bfloat16)
    write_index(folder, meta, [entry])
    store = FeatureStore(folder)
    sample = store.sample(0)         # SampleFeatures: input_ids, loss_mask, taps, hidden
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from eyas.errors import EyasError
from eyas.utils.io import atomic_path, file_sha256, read_json, write_json_atomic

INDEX_NAME = "index.json"
STORE_FORMAT = "eyas-features"
STORE_VERSION = 1
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
OPEN_SHARDS = 32  # shard handles kept open (memory-mapped) at once


@dataclass
class SampleFeatures:
    id: str
    input_ids: Tensor  # int64 [T]
    loss_mask: Tensor  # int64 [T]
    taps: Tensor  # [T, 3H] store dtype
    hidden: Tensor  # [T, H] store dtype


@dataclass
class ShardEntry:
    file: str
    sha256: str
    bytes: int
    shapes: dict[str, list[int]]
    sample_ids: list[str]
    lengths: list[int]
    skipped: list[str] = field(default_factory=list)  # ids with nothing to train on

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class StoreMeta:
    target_model: str
    target_layer_ids: list[int]  # boundary ids
    target_num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    max_length: int

    def __post_init__(self) -> None:
        if self.dtype not in STORE_DTYPES:
            raise EyasError(f"feature dtype '{self.dtype}' is not supported; accepted: "
                            f"{', '.join(STORE_DTYPES)}")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def bytes_per_token(hidden_size: int, num_taps: int, dtype: str) -> int:
    """Storage of one token: taps + last hidden state + int32 id + uint8 mask."""
    return (num_taps + 1) * hidden_size * STORE_DTYPES[dtype].itemsize + 4 + 1


def write_shard(folder: str | Path, index: int, samples: list[SampleFeatures], dtype: torch.dtype,
                skipped: list[str] | None = None) -> ShardEntry:
    """Pack `samples` into shard `index`; write it and its entry atomically; return the entry."""
    folder = Path(folder)
    lengths = [s.input_ids.numel() for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0) if samples else offsets[1:]
    taps_width = samples[0].taps.shape[-1] if samples else 0
    hidden_width = samples[0].hidden.shape[-1] if samples else 0
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32)
        if samples else torch.zeros(0, dtype=torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8)
        if samples else torch.zeros(0, dtype=torch.uint8),
        "offsets": offsets,
        "taps": torch.cat([s.taps for s in samples]).to(dtype)
        if samples else torch.zeros(0, taps_width, dtype=dtype),
        "hidden": torch.cat([s.hidden for s in samples]).to(dtype)
        if samples else torch.zeros(0, hidden_width, dtype=dtype),
    }
    path = folder / shard_name(index)
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"format": STORE_FORMAT})
        sha256, size = file_sha256(tmp), tmp.stat().st_size
    entry = ShardEntry(
        file=path.name, sha256=sha256, bytes=size,
        shapes={name: list(t.shape) for name, t in tensors.items()},
        sample_ids=[s.id for s in samples], lengths=lengths, skipped=list(skipped or []),
    )
    write_json_atomic(folder / f"{path.stem}.json", asdict(entry))
    return entry


def entry_path(folder: str | Path, index: int) -> Path:
    return Path(folder) / f"{Path(shard_name(index)).stem}.json"


def read_shard_entry(folder: str | Path, index: int) -> ShardEntry | None:
    """The entry of a completed shard, or None when the shard is missing or incomplete."""
    folder = Path(folder)
    if not entry_path(folder, index).is_file() or not (folder / shard_name(index)).is_file():
        return None
    return ShardEntry(**json.loads(entry_path(folder, index).read_text()))


def shard_problem(folder: str | Path, entry: ShardEntry) -> str | None:
    """What is wrong with a shard's file against its entry, or None when it verifies.

    Checked in order: present, size, sha256, and a safetensors header whose tensors have the
    entry's shapes (the file can be opened and read).
    """
    path = Path(folder) / entry.file
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != entry.bytes:
        kind = "truncated" if size < entry.bytes else "longer than written"
        return f"is {kind} ({size} bytes, {entry.bytes} written)"
    actual = file_sha256(path)
    if actual != entry.sha256:
        return f"is corrupted: sha256 {actual[:16]}... does not match {entry.sha256[:16]}... recorded for it"
    try:
        with safe_open(str(path), framework="pt") as handle:
            shapes = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as error:  # SafetensorError and friends: a header that does not parse
        return f"cannot be read ({error})"
    if shapes != entry.shapes:
        return f"holds tensors of shapes {shapes}, its entry lists {entry.shapes}"
    return None


def check_completed_shard(folder: str | Path, index: int) -> tuple[ShardEntry | None, str | None]:
    """(entry, None) for a shard that verifies; (None, problem) for one on disk that does not;
    (None, None) for a shard never started. Used to decide what a resumed run may skip."""
    folder = Path(folder)
    shard_path, json_path = folder / shard_name(index), entry_path(folder, index)
    if not json_path.is_file():
        return None, ("has no entry file (an interrupted write)" if shard_path.is_file() else None)
    try:
        entry = ShardEntry(**json.loads(json_path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as error:
        return None, f"has an unreadable entry file {json_path.name} ({error})"
    problem = shard_problem(folder, entry)
    return (entry, None) if problem is None else (None, problem)


def write_index(folder: str | Path, meta: StoreMeta, entries: list[ShardEntry]) -> Path:
    hidden = meta.hidden_size
    num_taps = len(meta.target_layer_ids)
    index = {
        "format": STORE_FORMAT,
        "format_version": STORE_VERSION,
        **asdict(meta),
        "num_samples": sum(len(e.sample_ids) for e in entries),
        "num_tokens": sum(e.num_tokens for e in entries),
        "bytes": sum(e.bytes for e in entries),
        "tensors": {
            "input_ids": "int32 [tokens]",
            "loss_mask": "uint8 [tokens] (1 = answer token)",
            "offsets": "int64 [samples + 1]",
            "taps": f"{meta.dtype} [tokens, {num_taps * hidden}] residual entering layers "
                    f"{meta.target_layer_ids}",
            "hidden": f"{meta.dtype} [tokens, {hidden}] last hidden state after the final norm",
        },
        "shards": [asdict(e) for e in entries],
    }
    path = Path(folder) / INDEX_NAME
    write_json_atomic(path, index)
    return path


class FeatureStore:
    """Read access to a store folder; shards are verified (sha256) when first opened."""

    def __init__(self, folder: str | Path, verify: bool = True) -> None:
        self.folder = Path(folder)
        index_path = self.folder / INDEX_NAME
        if not index_path.is_file():
            raise EyasError(f"{self.folder} is not a feature store: no {INDEX_NAME} (run `eyas "
                            f"features` to the end; an interrupted run resumes where it stopped)")
        index = read_json(index_path)
        if index.get("format") != STORE_FORMAT:
            raise EyasError(f"{index_path} is not an eyas feature index (format "
                            f"{index.get('format')!r})")
        if index.get("format_version", 0) > STORE_VERSION:
            raise EyasError(f"feature store version {index['format_version']} is newer than this "
                            f"eyas reads ({STORE_VERSION})")
        self.index: dict[str, Any] = index
        meta_keys = StoreMeta.__dataclass_fields__
        self.meta = StoreMeta(**{k: index[k] for k in meta_keys})
        self.shards = [ShardEntry(**entry) for entry in index["shards"]]
        self.verify_checksums = verify
        self._verified: set[int] = set()
        self._handles: OrderedDict[int, Any] = OrderedDict()
        # sample number -> (shard, sample within the shard, first row, length)
        self._rows: list[tuple[int, int, int, int]] = []
        for shard_index, entry in enumerate(self.shards):
            start = 0
            for local, length in enumerate(entry.lengths):
                self._rows.append((shard_index, local, start, length))
                start += length

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.shards)

    def sample_id(self, number: int) -> str:
        shard_index, local, _, _ = self._rows[number]
        return self.shards[shard_index].sample_ids[local]

    def length(self, number: int) -> int:
        return self._rows[number][3]

    # ---- integrity -----------------------------------------------------------------------------
    def verify_shard(self, shard_index: int) -> None:
        entry = self.shards[shard_index]
        problem = shard_problem(self.folder, entry)
        if problem is not None:
            raise EyasError(
                f"feature shard {self.folder / entry.file} {problem} (listed in {INDEX_NAME}); "
                f"re-run `eyas features` with the same arguments: it checks every shard and rebuilds this one"
            )
        self._verified.add(shard_index)

    def verify(self) -> None:
        """Check every shard's sha256 (reads the whole store once)."""
        for shard_index in range(len(self.shards)):
            self.verify_shard(shard_index)

    def _handle(self, shard_index: int) -> Any:
        if shard_index in self._handles:
            self._handles.move_to_end(shard_index)
            return self._handles[shard_index]
        if self.verify_checksums and shard_index not in self._verified:
            self.verify_shard(shard_index)
        path = self.folder / self.shards[shard_index].file
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as error:  # a truncated or rewritten file when checksums are off
            raise EyasError(f"feature shard {path} cannot be read: {error}") from None
        self._handles[shard_index] = handle
        if len(self._handles) > OPEN_SHARDS:
            self._handles.popitem(last=False)
        return handle

    # ---- reading -------------------------------------------------------------------------------
    def sample(self, number: int) -> SampleFeatures:
        shard_index, local, start, length = self._rows[number]
        handle = self._handle(shard_index)
        rows = slice(start, start + length)
        return SampleFeatures(
            id=self.shards[shard_index].sample_ids[local],
            input_ids=handle.get_slice("input_ids")[rows].long(),
            loss_mask=handle.get_slice("loss_mask")[rows].long(),
            taps=handle.get_slice("taps")[rows],
            hidden=handle.get_slice("hidden")[rows],
        )

    def iter_token_arrays(self) -> Iterator[tuple[Tensor, Tensor]]:
        """(input_ids [T], loss_mask [T]) of every sample, in order, without reading features."""
        for shard_index, entry in enumerate(self.shards):
            handle = self._handle(shard_index)
            ids, mask = handle.get_tensor("input_ids").long(), handle.get_tensor("loss_mask").long()
            start = 0
            for length in entry.lengths:
                yield ids[start:start + length], mask[start:start + length]
                start += length
