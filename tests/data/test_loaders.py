"""Readers: the streaming JSON array reader, each file format and each record shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_support import FIXTURES
from eyas.data.json_stream import Element, ElementError, iter_json_array
from eyas.data.records import Message, RecordError, conversation_from_dict
from eyas.data.sources import RawError, RawRecord, read_raw_records, resolve_source
from eyas.errors import EyasError


def line_of(path: Path, needle: str) -> int:
    """1-based line of the `{` that opens the record holding `needle` (the line before it)."""
    lines = path.read_text().splitlines()
    return next(index for index, line in enumerate(lines, start=1) if needle in line) - 1


def test_truncated_sharegpt_keeps_every_whole_record() -> None:
    path = FIXTURES / "sharegpt_truncated.json"
    items = list(iter_json_array(path))
    whole = [item for item in items if isinstance(item, Element)]
    broken = [item for item in items if isinstance(item, ElementError)]
    assert [item.value["id"] for item in whole] == [f"a{i}_0" for i in range(1, 8)]
    assert broken == [ElementError("truncated", line_of(path, '"a8_0"'))]
    assert whole[1].line == line_of(path, '"a2_0"')


@pytest.mark.parametrize("chunk_chars", [1, 7, 64, 1 << 20])
def test_json_array_is_the_same_whatever_the_chunk_size(tmp_path: Path, chunk_chars: int) -> None:
    records = [{"id": i, "text": "x" * i + "{[\"\\"} for i in range(30)] + [3, "s", [1, [2]]]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(records, indent=1))
    values = [item.value for item in iter_json_array(path, chunk_chars=chunk_chars)]
    assert values == records


def test_broken_element_in_the_middle_is_skipped_and_reading_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text('[\n{"id": 1},\n{"id": 2, "x": tru},\n{"id": 3}\n]')
    items = list(iter_json_array(path, chunk_chars=5))
    assert items[0] == Element({"id": 1}, 2)
    assert isinstance(items[1], ElementError) and items[1].line == 3 and items[1].reason.startswith("invalid JSON")
    assert items[2] == Element({"id": 3}, 4)


def test_not_an_array_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text('{"id": 1}')
    with pytest.raises(EyasError, match="JSON array"):
        list(read_raw_records(resolve_source(str(path))))


def test_jsonl_reports_bad_lines_with_their_numbers() -> None:
    items = list(read_raw_records(resolve_source(str(FIXTURES / "specforge.jsonl"))))
    assert [type(item) for item in items] == [RawRecord, RawRecord, RawError, RawRecord, RawRecord]
    assert items[2].line == 3 and items[2].reason.startswith("invalid JSON")
    with pytest.raises(RecordError, match="must be a list"):
        conversation_from_dict(items[3].value, "specforge", "x")


def test_record_shapes_normalise_roles() -> None:
    sharegpt = conversation_from_dict(
        {"id": "s", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, "sg", "f")
    assert sharegpt.messages == [Message("user", "q"), Message("assistant", "a")]
    openai_items = list(read_raw_records(resolve_source(str(FIXTURES / "openai.jsonl"))))
    poem = conversation_from_dict(openai_items[0].value, "openai", "openai-1")
    assert poem.id == "openai-1" and poem.messages[1] == Message("user", "Write about the sea.")
    with pytest.raises(RecordError, match="non-text content part 'image_url'"):
        conversation_from_dict(openai_items[1].value, "openai", "openai-2")
    assert openai_items[2].line == 4  # the blank line 3 is skipped, numbering is kept
    mtbench = list(read_raw_records(resolve_source(str(FIXTURES / "mtbench_question.jsonl"))))
    first = conversation_from_dict(mtbench[0].value, "mtbench", "x")
    assert first.id == "81" and len(first.user_turns) == 2 and first.meta == {"category": "writing"}
    with pytest.raises(RecordError, match="unknown role 'alien'"):
        conversation_from_dict({"conversations": [{"from": "alien", "value": "?"}]}, "sg", "f")


def test_parquet_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "id": ["p1", "p2"],
        "conversations": [[{"from": "human", "value": "hello"}], [{"from": "gpt", "value": "only answer"}]],
    })
    path = tmp_path / "chats.parquet"
    pq.write_table(table, path)
    items = list(read_raw_records(resolve_source(str(path))))
    assert [item.line for item in items] == [1, 2]
    assert conversation_from_dict(items[0].value, "chats", "x").user_turns == ["hello"]


def test_embedded_sources_resolve_without_importing_their_packages() -> None:
    for name in ("sharegpt", "mtbench"):
        try:
            source = resolve_source(name)
        except EyasError as error:
            pytest.skip(str(error))
        assert source.path.is_file() and source.name == name


def test_unknown_source_names_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(EyasError, match="sharegpt"):
        resolve_source("no-such-dataset")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(EyasError, match=r"\.jsonl"):
        resolve_source(str(tmp_path / "data.csv"))
