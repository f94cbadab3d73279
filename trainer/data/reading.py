"""Records in bounded batches: how `prepare` reads a source without holding it (records.load_records loads whole).

A source (a file, a directory of files, a hub dataset) is read in two passes. The first counts its records, which
is all the eval split needs (records.eval_indices). The second yields them in order in chunks of about
CHUNK_BYTES, for the tokenizer processes (trainer/data/encode.py):

  lines  a piece of a JSON-lines or text file cut at line ends: the raw bytes go to a tokenizer process, which
         decodes and parses them itself, so the bulk of a corpus never becomes Python objects in the parent
  rows   a slice of a parquet file (only the fields used), of a JSON document, or of a hub dataset

Records are numbered as `load_records` numbers them (a blank line is not a record; origins "path line N", "path row
N", "name row N"), so the eval split, the shards and every error are what they were when a source was loaded whole.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from ..files import loads_unique
from ..paths import is_there
from .records import (FILE_FORMATS, ORIGIN, DataError, data_files, decode_line, hub_dataset, json_rows,
                      looks_like_path, read_utf8)

CHUNK_BYTES = 256 << 10  # a chunk: ~256 KB of text (a tokenizer process holds ~100x that in its encodings);
CHUNK_LINES = 4096       # at most this many lines (short records cost per record, not per byte). Small chunks keep
                         # the processes' memory low and their ends together: the last chunk is the only wait
COUNT_BYTES = 32 << 20  # the first pass: a process counts the records of this many bytes of a file at a time
LINES = ("jsonl", "txt")  # the kinds read as lines
BOM = "\ufeff"          # some editors start a UTF-8 file with it; Arrow's JSON reader (used before) skipped it


@dataclass
class Chunk:
    """Records [first_record, first_record + records) of a source; the first line or row is number `first_number`
    of `origin` (a record's origin is f"{origin} {number}")."""
    kind: str           # "jsonl" or "txt" (payload: bytes of whole lines), "rows" (payload: {field: values})
    origin: str
    first_number: int
    records: int
    payload: Any
    offset: int = 0     # lines: the file offset of payload[0] (a UTF-8 error names it)
    first_record: int = 0


@dataclass
class SourceFile:
    """One file of a source, or the hub dataset: `kind` says how it is read."""
    path: Path
    kind: str           # "jsonl", "txt", "json" (a JSON document), "parquet", "hub"
    name: str           # what origins and errors call it


class SourceReader:
    """A source as `load_records` sees it, read in chunks; `count` is the first pass, `chunks` the second."""

    def __init__(self, source: str, split: str = "train", subset: Optional[str] = None):
        self.source, self.split, self.subset = source, split, subset
        self.hub = None
        if not source:
            raise DataError("data.source is empty; set it to a .jsonl/.json/.parquet/.txt file, a directory "
                            "of them, or a hub dataset name")
        path = Path(source).expanduser()
        if is_there(path, "data source"):
            self.parts = [self._part(f) for f in _files(path)]
        elif looks_like_path(source):
            raise DataError(f"{source}: no such file or directory; fix data.source / data.eval_source")
        else:
            self.hub = hub_dataset(source, split, subset)  # memory-mapped from the datasets cache
            self.parts = [SourceFile(path, "hub", source)]
        self.counts: Optional[list[int]] = None

    @staticmethod
    def _part(path: Path) -> SourceFile:
        if path.suffix not in FILE_FORMATS:
            raise DataError(f"{path}: unsupported file type {path.suffix!r}; use {', '.join(FILE_FORMATS)}")
        if not path.is_file():  # a FIFO or a device would block or never end
            raise DataError(f"{path}: not a regular file (a FIFO, a device or a socket); give a data file")
        kind = path.suffix[1:]
        if kind == "json":
            kind = _json_kind(path)
        return SourceFile(path, kind, str(path))

    # --- the first pass ----------------------------------------------------------------------------

    def count_tasks(self) -> list[tuple[str, int, int]]:
        """(path, start, end) of the pieces of the line files whose records a process counts (`count_lines`)."""
        self.pieces = {part.path: _pieces(part.path, COUNT_BYTES) for part in self.parts if part.kind in LINES}
        return [(str(path), start, end) for path, pieces in self.pieces.items() for start, end in pieces]

    def count(self, line_counts: list[int]) -> int:
        """The number of records; `line_counts`: `count_lines` of each of `count_tasks`, in order."""
        remaining, self.counts = iter(line_counts), []
        for part in self.parts:
            if part.kind in LINES:
                self.counts.append(sum(next(remaining) for _ in self.pieces[part.path]))
            else:
                self.counts.append(_row_count(part, self.hub))
        total = sum(self.counts)
        if total == 0:
            raise DataError(f"{self.source}: holds no records; point data.source at a non-empty dataset")
        return total

    # --- the second pass ---------------------------------------------------------------------------

    def head(self) -> tuple[list[str], str]:
        """(the fields of the first chunk's records, the origin of the first record): what decides the format."""
        for part in self.parts:
            for chunk in self._part_chunks(part, fields=None):
                if chunk.records:
                    return chunk_columns(chunk), f"{chunk.origin} {first_number(chunk)}"
        raise DataError(f"{self.source}: holds no records; point data.source at a non-empty dataset")

    def chunks(self, fields: list[str]) -> Iterator[Chunk]:
        """Every record in order, in chunks carrying `fields` (rows) or raw lines; each chunk knows the index of its
        first record. A file whose records no longer add up to the first pass's count changed in between."""
        first = 0
        for part, expected in zip(self.parts, self.counts):
            seen = 0
            for chunk in self._part_chunks(part, fields):
                chunk.first_record, seen, first = first, seen + chunk.records, first + chunk.records
                if seen > expected:
                    break
                yield chunk
            if seen != expected:
                raise changed(part.name)

    def _part_chunks(self, part: SourceFile, fields: Optional[list[str]]) -> Iterator[Chunk]:
        if part.kind in LINES:
            yield from _line_chunks(part)
        elif part.kind == "parquet":
            yield from _parquet_chunks(part, fields)
        elif part.kind == "hub":
            yield from _hub_chunks(self.hub, part.name, fields)
        else:
            rows = _json_document_rows(part.path)
            for start in range(0, len(rows), CHUNK_LINES):
                batch = rows[start:start + CHUNK_LINES]
                yield Chunk("rows", f"{part.path} row", start + 1, len(batch), _columns_of(batch, fields))


def changed(name: str) -> DataError:
    return DataError(f"{name} changed while it was being prepared (its records no longer match what the first pass "
                     f"counted): prepare it again once it is no longer being written")


def _files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    return data_files(path)


def _opened(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:  # unreadable (permissions, an I/O error, a file removed since)
        raise DataError(f"{path}: cannot read it ({e.strerror or e}); check data.source and its permissions") \
            from None


# --- lines: JSON lines and text --------------------------------------------------------------------

def is_blank(raw: bytes) -> bool:
    """A line load_records skips: nothing but whitespace once decoded (str.strip's, which is more than ASCII's).
    Undecodable bytes are not whitespace: such a line is a record, and reading it names the bad byte."""
    return not raw.decode("utf-8", "replace").strip()


def line_starts(data: bytes) -> np.ndarray:
    """Offsets of the lines of `data` (whole lines; the last may lack its newline)."""
    newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    starts = np.concatenate(([0], newlines + 1))
    return starts[:-1] if starts[-1] == len(data) else starts


def blank_lines(data: bytes, starts: np.ndarray) -> int:
    """How many of the lines are blank: only a line that starts with a space, a control or a non-ASCII byte
    can be, and only those are decoded to see."""
    if not len(starts):
        return 0
    view = np.frombuffer(data, dtype=np.uint8)
    first = view[starts]
    doubtful = np.flatnonzero((first < 0x21) | (first > 0x7e))
    ends = np.append(starts[1:], len(data))
    return sum(is_blank(data[starts[i]:ends[i]]) for i in doubtful)


def count_lines(task: tuple[str, int, int]) -> int:
    """The records among the whole lines in [start, end) of a file (the first pass, in a tokenizer process)."""
    path, start, end = task
    records, carry = 0, b""
    with _opened(Path(path)) as f:
        f.seek(start)
        while start < end:
            block = f.read(min(COUNT_BYTES, end - start))
            if not block:
                raise changed(path)
            start += len(block)
            data = carry + block
            cut = data.rfind(b"\n") + 1 if start < end else len(data)  # a line cut by the block waits for the rest
            data, carry = data[:cut], data[cut:]
            starts = line_starts(data) if data else np.zeros(0, dtype=np.int64)
            records += len(starts) - blank_lines(data, starts)
    return records


def _pieces(path: Path, size: int) -> list[tuple[int, int]]:
    """Ranges of about `size` bytes that start and end at line ends."""
    total, cuts = path.stat().st_size, [0]
    with _opened(path) as f:
        while cuts[-1] + size < total:
            f.seek(cuts[-1] + size)
            f.readline()
            if f.tell() >= total:
                break
            cuts.append(f.tell())
    return list(zip(cuts, cuts[1:] + [total]))


def _line_chunks(part: SourceFile) -> Iterator[Chunk]:
    with _opened(part.path) as f:
        offset, line = 0, 1
        while data := f.read(CHUNK_BYTES):
            if not data.endswith(b"\n"):
                data += f.readline()  # to the end of the line (or of the file)
            starts = line_starts(data)
            if len(starts) > CHUNK_LINES:
                data, starts = data[:starts[CHUNK_LINES]], starts[:CHUNK_LINES]
                f.seek(offset + len(data))
            records = len(starts) - blank_lines(data, starts)
            yield Chunk(part.kind, f"{part.path} line", line, records, data, offset)
            offset, line = offset + len(data), line + len(starts)


def chunk_lines(chunk: Chunk, wanted: Optional[np.ndarray]) -> tuple[list[int], list[dict]]:
    """(line numbers, records) of the chunk's records where `wanted` (one flag per record; None: all), read as
    load_records reads them: every problem is a DataError naming the file and line."""
    numbers, records, record, offset = [], [], -1, chunk.offset
    for number, raw in enumerate(chunk.payload.split(b"\n"), chunk.first_number):
        start, offset = offset, offset + len(raw) + 1
        if not b"!" <= raw[:1] <= b"~" and is_blank(raw):
            continue
        record += 1
        if wanted is not None and not wanted[record]:
            continue
        line = decode_line(raw, f"{chunk.origin} {number}", start)
        numbers.append(number)
        records.append(_parsed(line, chunk.kind, f"{chunk.origin} {number}", start))
    return numbers, records


def _parsed(line: str, kind: str, where: str, start: int) -> dict:
    if kind == "txt":
        return {"text": line.rstrip("\r\n")}
    try:
        record = loads_unique(line[1:] if start == 0 and line.startswith(BOM) else line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON at column {e.colno} ({e.msg}); each line must hold one JSON object, "
                        f"e.g. {{\"text\": \"...\"}}") from None
    except ValueError as e:  # a key given twice
        raise DataError(f"{where}: {e}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}; each record must be an object "
                        f"such as {{\"text\": \"...\"}}")
    return record


# --- rows: parquet, JSON documents, hub datasets ---------------------------------------------------

def _json_kind(path: Path) -> str:
    """'json' when the whole file is one JSON value (an array of records, {"data": [...]}, one record), else
    'jsonl' (many .json files are JSON lines): what load_records decides by parsing the whole file, decided here
    from its first line unless that line alone is not a JSON value."""
    with _opened(path) as f:
        first = f.readline()
        while first and not first.strip():
            first = f.readline()
        rest = f.read(1 << 16)
        while rest and not rest.strip():
            rest = f.read(1 << 16)
    if first.lstrip().startswith(b"["):
        return "json"
    try:
        json.loads(first)
    except ValueError:
        try:  # a value spread over lines (pretty-printed), or no JSON at all (then named as JSON lines)
            json.loads(read_utf8(path))
            return "json"
        except ValueError:
            return "jsonl"
    return "jsonl" if rest.strip() else "json"


def _json_document_rows(path: Path) -> list[dict]:
    text = read_utf8(path)
    try:
        data = loads_unique(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno}: invalid JSON at column {e.colno} ({e.msg}); the file "
                        f"must be a JSON array of objects or JSON lines") from None
    except ValueError as e:  # a key given twice
        raise DataError(f"{path}: {e}") from None
    rows = json_rows(data)
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {i}: expected a JSON object, got {type(row).__name__}; each record "
                            f"must be an object such as {{\"text\": \"...\"}}")
    return rows


def _row_count(part: SourceFile, hub) -> int:
    if part.kind == "hub":
        return len(hub)
    if part.kind == "parquet":
        return _parquet(part.path).metadata.num_rows
    return len(_json_document_rows(part.path))


def _parquet(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from e


def _rows_per_chunk(table_bytes: int, rows: int) -> int:
    return int(min(CHUNK_LINES, max(1, CHUNK_BYTES * rows // max(table_bytes, 1))))


def _parquet_chunks(part: SourceFile, fields: Optional[list[str]]) -> Iterator[Chunk]:
    parquet = _parquet(part.path)
    names = parquet.schema_arrow.names
    present = [f for f in fields if f in names] if fields is not None else names
    meta = parquet.metadata
    size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    number = 1
    for batch in parquet.iter_batches(batch_size=_rows_per_chunk(size, meta.num_rows), columns=present):
        payload = {name: _compact(batch.column(name)) for name in present}
        yield Chunk("rows", f"{part.path} row", number, batch.num_rows, _with_missing(payload, fields))
        number += batch.num_rows


def _hub_chunks(dataset, name: str, fields: Optional[list[str]]) -> Iterator[Chunk]:
    present = [f for f in fields if f in dataset.column_names] if fields is not None else dataset.column_names
    table = dataset.select_columns(present).with_format("arrow")
    step = _rows_per_chunk(dataset.data.nbytes, len(dataset))
    for start in range(0, len(dataset), step):
        batch = table[start:start + step]
        payload = {column: _compact(batch.column(column)) for column in present}
        yield Chunk("rows", f"{name} row", start + 1, batch.num_rows, _with_missing(payload, fields))


def _compact(column):
    """These rows in buffers of their own: a slice of an Arrow array pickles with all of the buffers it was cut from
    (a whole row group, or the whole memory-mapped dataset) when it is handed to a tokenizer process."""
    import pyarrow as pa
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else pa.concat_arrays([column])


def _with_missing(payload: dict, fields: Optional[list[str]]) -> dict:
    """Fields a file lacks are None in every record (so each record names the missing field)."""
    return payload if fields is None else {field: payload.get(field) for field in fields}


def _columns_of(rows: list[dict], fields: Optional[list[str]]) -> dict:
    names = list(dict.fromkeys(key for row in rows for key in row)) if fields is None else fields
    return {name: [row.get(name) for row in rows] for name in names}


def chunk_rows(chunk: Chunk, wanted: Optional[np.ndarray]) -> tuple[list[int], list[dict]]:
    """(row numbers, records) of a rows chunk where `wanted`."""
    picked = range(chunk.records) if wanted is None else np.flatnonzero(wanted).tolist()
    columns = {name: _values(values) for name, values in chunk.payload.items()}
    records = [{name: values[i] if values is not None else None for name, values in columns.items()} for i in picked]
    return [chunk.first_number + i for i in picked], records


def _values(values) -> Optional[list]:
    if values is None or isinstance(values, list):
        return values
    return values.to_pylist()  # an Arrow column


def chunk_records(chunk: Chunk, wanted: Optional[np.ndarray] = None) -> tuple[list[int], list[dict]]:
    return chunk_rows(chunk, wanted) if chunk.kind == "rows" else chunk_lines(chunk, wanted)


def chunk_columns(chunk: Chunk) -> list[str]:
    if chunk.kind == "rows":
        return [name for name in chunk.payload if name != ORIGIN]
    _, records = chunk_lines(chunk, None)
    return [name for name in dict.fromkeys(key for record in records for key in record) if name != ORIGIN]


def first_number(chunk: Chunk) -> int:
    return chunk_records(chunk, np.arange(chunk.records) == 0)[0][0]
