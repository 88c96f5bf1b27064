"""Reading JSON Lines by byte range: the unit of work that ``corpus.py`` hands to parallel
tokenising workers, shared by plain documents (``corpus.py``) and instruction examples
(``instruct.py``) so that neither imports the other to read a line.

No communication: pure file reading.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


class RecordError(Exception):
    """A bad JSON Lines record at line ``line`` of its unit (``read_unit`` does not know
    the line numbers before the unit; its caller does)."""

    def __init__(self, line: int, message: str):
        super().__init__(line, message)
        self.line, self.message = line, message


@dataclass
class UnitStats:
    """What reading a unit found besides documents."""

    lines: int = 0  # JSON Lines: lines read, blank ones included
    skipped: list[str] = field(default_factory=list)  # binary files in a folder
    replaced: int = 0  # files with bytes that are not UTF-8


def jsonl_lines(f: Path, start: int, stop: int, stats: UnitStats) -> Iterator[tuple[int, str]]:
    """(line number in the unit, text) of the non-blank lines of ``f`` that start in bytes
    [start, stop); ``stats.lines`` counts the blank ones too."""
    with open(f, "rb") as lines:
        if start > 0:
            lines.seek(start - 1)
            if lines.read(1) != b"\n":
                lines.readline()  # the rest of a line that started in the previous unit
        while lines.tell() < stop:
            line = lines.readline()
            if not line:
                break
            stats.lines += 1
            if start == 0 and stats.lines == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]  # a byte-order mark
            text = line.decode("utf-8", errors="replace")
            if text.strip():
                yield stats.lines, text
