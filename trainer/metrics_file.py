"""`metrics.jsonl` read back: the one reader of the file for every part of the trainer that reads it (the rewind
at a resume or a fresh start, trainer/train/metrics.py; `report`, trainer/report/runs.py).

The file is read line by line, forward or backward, in memory bounded by MAX_LINE_BYTES whatever its size, and
no line can stop the reader: a process killed mid-write leaves a torn last line (a partial JSON object, half
of a multi-byte character), a full disk or a hand edit can leave worse anywhere. Every non-blank line comes
back as a `Line`: its number, its bytes, and either the JSON object it holds (`row`, with a whole-number
"step") or why it is not a metrics line (`problem`). What a problem means is the caller's: the rewind moves
the line aside with its bytes, report skips it and names it as file:line.

NaN and Infinity are accepted as numbers: the trainer writes a non-finite loss as Python's json does.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO, Iterator, NamedTuple, Optional

from .errors import short


METRICS_FILE = "metrics.jsonl"
REWOUND_FILE = "metrics.rewound.jsonl"
MAX_LINE_BYTES = 16 << 20   # a train line is ~300 bytes, a line of sample generations a few KB
MAX_STEP = 2 ** 53          # past it a step is no longer exact as a float (the report's x axis)
KEPT_BYTES = 4096           # what a Line keeps of a longer line (the rest is counted, not held)
BLOCK_BYTES = 1 << 20


class Line(NamedTuple):  # a tuple, not a dataclass: a million of them are made per million steps read
    number: int               # 1-based, as an editor counts
    raw: bytes                # the line without its newline (a line over MAX_LINE_BYTES: its first KEPT_BYTES)
    size: int                 # the line's length in bytes
    row: Optional[dict]       # the metrics line, when it is one
    problem: Optional[str]    # else why it is not

    @property
    def step(self) -> int:
        return self.row["step"]


def forward(path: Path) -> Iterator[Line]:
    """The file's lines, first to last."""
    with open(path, "rb") as handle:
        number = 0
        while chunk := handle.readline(MAX_LINE_BYTES + 1):
            number += 1
            complete = chunk.endswith(b"\n")
            if not complete and len(chunk) > MAX_LINE_BYTES:
                yield too_long(number, chunk[:KEPT_BYTES], len(chunk) + _skip_line(handle))
            elif chunk.strip():
                yield parsed(number, chunk[:-1] if complete else chunk, torn=not complete)


def backward(path: Path) -> Iterator[Line]:
    """The file's lines, last to first (what `report` needs to know which lines a later resume replaced), as it
    was when opened: a run still writing adds lines that are not read."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        number = count_lines(handle, size)
        torn = size > 0 and _byte_at(handle, size - 1) != b"\n"
        position = size if torn else size - 1     # a final newline ends the last line; it starts none
        tail, tail_size = b"", 0                  # the end of the line being read (its start lies further back)
        while position > 0:
            start = max(0, position - BLOCK_BYTES)
            handle.seek(start)
            pieces = handle.read(position - start).split(b"\n")
            position = start
            for piece in reversed(pieces[1:]):    # each newline in the block completes the line after it
                if tail_size:
                    piece, size = piece + tail, len(piece) + tail_size
                    tail, tail_size = b"", 0
                else:
                    size = len(piece)
                if size > MAX_LINE_BYTES:
                    yield too_long(number, piece[:KEPT_BYTES], size)
                elif piece.strip():
                    yield parsed(number, piece, torn)
                number, torn = number - 1, False
            tail_size += len(pieces[0])
            tail = pieces[0] + tail if tail_size <= MAX_LINE_BYTES else (pieces[0] + tail)[:KEPT_BYTES]
        if tail_size > MAX_LINE_BYTES:
            yield too_long(number, tail[:KEPT_BYTES], tail_size)
        elif tail.strip():
            yield parsed(number, tail, torn)


def count_lines(handle: BinaryIO, size: int) -> int:
    """Lines in the first `size` bytes (a last line without its newline counts)."""
    handle.seek(0)
    newlines, remaining, last = 0, size, b"\n"
    while remaining > 0:
        block = handle.read(min(BLOCK_BYTES, remaining))
        if not block:
            break
        newlines += block.count(b"\n")
        remaining -= len(block)
        last = block[-1:]
    return newlines + (last != b"\n")


def _byte_at(handle: BinaryIO, offset: int) -> bytes:
    handle.seek(offset)
    return handle.read(1)


def _skip_line(handle: BinaryIO) -> int:
    """Read on past the end of the current line; the bytes it had left (its newline not counted)."""
    skipped = 0
    while chunk := handle.readline(BLOCK_BYTES):
        if chunk.endswith(b"\n"):
            return skipped + len(chunk) - 1
        skipped += len(chunk)
    return skipped


def too_long(number: int, start: bytes, size: int) -> Line:
    return Line(number, start, size, None, f"{size:,} bytes long, over the {MAX_LINE_BYTES:,} a metrics line may "
                                           f"have (not read; it starts {short(start[:40])})")


def parsed(number: int, raw: bytes, torn: bool = False) -> Line:
    """A Line for these bytes; `torn`: it is the file's last and has no newline (a write the process did not
    finish), which the problem says."""
    row, problem = parse(raw)
    if problem and torn:
        problem += " (the last line has no newline: a write cut short when the process was killed or the disk filled)"
    return Line(number, raw, len(raw), row, problem)


def parse(raw: bytes) -> tuple[Optional[dict], Optional[str]]:
    """(the metrics line, None) or (None, why these bytes are not one)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1})"
    try:
        row = _DECODER.decode(text)
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({err.msg} at column {err.colno})"
    except ValueError as err:  # a duplicate key; an integer of more than 4,300 digits
        return None, f"not a metrics line: {short(str(err), 160)}"
    except RecursionError:
        return None, "not a metrics line: nested too deeply"
    if not isinstance(row, dict):
        return None, f"a metrics line is a JSON object {{\"step\": ...}}, not {short(row, 60)}"
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        return None, f"\"step\" must be a whole number from 0 to 2**53, got {short(step, 60)}"
    return row, None


def _object(pairs: list[tuple]) -> dict:
    row = dict(pairs)
    if len(row) != len(pairs):
        seen: set = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"the key {short(twice, 60)} is given twice")
    return row


_DECODER = json.JSONDecoder(object_pairs_hook=_object)  # a duplicate key is a problem, not a silent overwrite
