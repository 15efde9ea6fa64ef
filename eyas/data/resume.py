"""A jsonl output that a run can be resumed on: which ids are done, and atomic per-record appends.

Usage:
    output = ResumableJsonl(path)
    done = output.done_ids()          # ids already written (a torn last line is cut off first)
    output.append(record_dict)        # one write of one whole line, flushed and fsynced

A process killed in the middle of `append` can leave at most a partial last line (no newline);
`done_ids` removes it, so the record is written again in full by the next run and never twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eyas.errors import EyasError


class ResumableJsonl:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.torn_lines_removed = 0

    def done_ids(self) -> set[str]:
        if not self.path.exists():
            return set()
        self._cut_torn_tail()
        done = set()
        with open(self.path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    done.add(self._record_id(line, number))
        return done

    def _record_id(self, line: str, number: int) -> str:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            record, problem = None, f"is not valid JSON ({error})"
        else:
            problem = "has no 'id'"
        if isinstance(record, dict) and "id" in record:
            return str(record["id"])
        raise EyasError(f"{self.path} line {number} {problem}: this output cannot be resumed safely; "
                        "remove or fix that line, then run the same command again")

    def _cut_torn_tail(self) -> None:
        size = self.path.stat().st_size
        if size == 0:
            return
        with open(self.path, "rb+") as handle:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) == b"\n":
                return
            # Find the last newline and cut everything after it.
            position = size
            while position > 0:
                step = min(1 << 16, position)
                handle.seek(position - step)
                block = handle.read(step)
                index = block.rfind(b"\n")
                if index >= 0:
                    position = position - step + index + 1
                    break
                position -= step
            handle.truncate(position)
            self.torn_lines_removed += 1

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(descriptor, line)
            while written < len(line):  # a short write: finish the line
                written += os.write(descriptor, line[written:])
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
