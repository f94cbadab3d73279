"""Records: local files (jsonl, json, parquet, txt, or a directory of them) or a hub dataset, and the eval split.

Each loaded record carries an `_origin` column ("path line N" / "path row N") until the final blocks are
built, so every `DataError` names the file and line.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from ..errors import UserError
from ..files import loads_unique
from ..paths import is_there
from ..lazy import lazy_module

datasets = lazy_module("datasets")  # reading raw records only: a training from prepared shards never imports it


IGNORE_INDEX = -100                      # labels the loss skips (torch CrossEntropyLoss default)


ORIGIN = "_origin"                       # per-record "path line N" / "path row N", for error messages




from ..named_inputs import FILE_FORMATS, looks_like_path  # noqa: E402,F401 (defined where `show` reads them)


class DataError(UserError, ValueError):
    """A problem with the data or its configuration; the message says where and how to fix it.

    A UserError, so the CLI prints it without a traceback; a ValueError for callers that catch those.
    """


# ------------------------------------------------------------------------------------------- loading


def load_records(source: str, split: str = "train", subset: str | None = None) -> datasets.Dataset:
    """Records from a local .jsonl/.json/.parquet/.txt file, a directory of them, or a hub dataset."""
    if not source:
        raise DataError("data.source is empty; set it to a .jsonl/.json/.parquet/.txt file, a directory "
                        "of them, or a hub dataset name")
    path = Path(source).expanduser()
    if is_there(path, "data source"):
        records = _read_directory(path) if path.is_dir() else _read_file(path)
    elif looks_like_path(source):
        raise DataError(f"{source}: no such file or directory; fix data.source / data.eval_source")
    else:
        records = _load_hub(source, split, subset)
    if len(records) == 0:
        raise DataError(f"{source}: holds no records; point data.source at a non-empty dataset")
    return records


def _load_hub(name: str, split: str, subset: str | None = None) -> datasets.Dataset:
    records = hub_dataset(name, split, subset)
    return records.add_column(ORIGIN, [f"{name} row {i}" for i in range(1, len(records) + 1)])


def hub_dataset(name: str, split: str, subset: str | None = None) -> datasets.Dataset:
    """A hub dataset as `datasets` caches it (memory-mapped), without origins."""
    try:
        return datasets.load_dataset(name, subset, split=split)
    except Exception as e:  # the hub raises many types; all mean "cannot use this source"
        raise DataError(f"{name}: not a local path, and loading it as a hub dataset (split {split!r}) "
                        f"failed: {e}") from e


def data_files(directory: Path) -> list[Path]:
    """The data files of a directory source, sorted: every non-hidden file with a data suffix. One with a data suffix
    that is not a regular file (a FIFO, a device, a dangling link) is an error, not skipped: it was meant as data."""
    named = sorted(p for p in directory.rglob("*") if p.suffix in FILE_FORMATS and not p.name.startswith("."))
    odd = [p for p in named if not p.is_file() and not p.is_dir()]
    if odd:
        raise DataError(f"{odd[0]}: not a regular file (a FIFO, a device, a socket or a dangling link) in the data "
                        f"directory {directory}; remove it or give a data file")
    files = [p for p in named if p.is_file()]
    if not files:
        raise DataError(f"{directory}: directory holds no {'/'.join(FILE_FORMATS)} files")
    return files


def _read_directory(directory: Path) -> datasets.Dataset:
    files = data_files(directory)
    parts = [_read_file(f) for f in files]
    for f, part in zip(files[1:], parts[1:]):
        if set(part.column_names) != set(parts[0].column_names):
            raise DataError(f"{f}: has columns {visible_columns(part)} but {files[0]} has {visible_columns(parts[0])}; "
                            f"all files of a directory source must share their columns")
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as e:
        raise DataError(f"{directory}: files disagree on column types ({e}); make each field one type") from e


def _read_file(path: Path) -> datasets.Dataset:
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".txt": _read_txt, ".parquet": _read_parquet}
    if path.suffix not in readers:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use {', '.join(FILE_FORMATS)}")
    if not path.is_file():  # a FIFO or a device would block or never end
        raise DataError(f"{path}: not a regular file (a FIFO, a device or a socket); give a data file")
    try:
        return readers[path.suffix](path)
    except OSError as e:  # unreadable (permissions, an I/O error, a file removed while read)
        raise DataError(f"{path}: cannot read it ({e.strerror or e}); check data.source and its permissions") \
            from None


def _read_jsonl(path: Path) -> datasets.Dataset:
    fast = _read_jsonl_with_arrow(path)
    if fast is not None:
        return fast
    # Parsed here line by line (not by datasets' JSON builder) so errors carry the exact line number.
    rows = []
    for number, line in _numbered_lines(path):
        try:
            record = loads_unique(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {number}: invalid JSON at column {e.colno} ({e.msg}); each line "
                            f"must hold one JSON object, e.g. {{\"text\": \"...\"}}") from None
        except ValueError as e:  # a key given twice
            raise DataError(f"{path} line {number}: {e}") from None
        rows.append(_checked_object(record, f"{path} line {number}"))
    return _records_from_rows(rows, path)


def _read_jsonl_with_arrow(path: Path) -> Optional[datasets.Dataset]:
    """Arrow's multithreaded JSON reader for a well-formed file without blank lines (row i is then line i); None
    for anything else, which the line-by-line reader reads again to name the exact line of the problem."""
    data = path.read_bytes()
    if not data.strip() or re.search(rb"(^|\n)[ \t\r]*(\n|$)", data.rstrip(b"\n")):
        return None
    try:
        data.decode("utf-8")  # Arrow's reader takes bad UTF-8 and fails later, far from the line
    except UnicodeDecodeError:
        return None
    try:
        table = pa_json.read_json(pa.BufferReader(data))
    except (pa.ArrowException, OSError):
        return None
    if any(_inferred(field.type) for field in table.schema):  # Arrow reads "2020-01-01" as a timestamp
        return None
    origins = pa.array([f"{path} line {i}" for i in range(1, table.num_rows + 1)], pa.string())
    return datasets.Dataset(datasets.table.InMemoryTable(table.append_column(ORIGIN, origins)))


def _inferred(kind: pa.DataType) -> bool:
    """A type Arrow's JSON reader made up from a string (dates, times): the text must stay text."""
    if pa.types.is_temporal(kind):
        return True
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _inferred(kind.value_type)
    if pa.types.is_struct(kind):
        return any(_inferred(kind.field(i).type) for i in range(kind.num_fields))
    return False


def _read_json(path: Path) -> datasets.Dataset:
    text = read_utf8(path)
    try:
        data = loads_unique(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):
            raise DataError(f"{path} line {e.lineno}: invalid JSON at column {e.colno} ({e.msg}); the file "
                            f"must be a JSON array of objects or JSON lines") from None
        return _read_jsonl(path)  # many .json files are really JSON lines
    except ValueError as e:  # a key given twice
        raise DataError(f"{path}: {e}") from None
    rows = [_checked_object(r, f"{path} row {i}") for i, r in enumerate(json_rows(data), 1)]
    return _records_from_rows(rows, path)


def json_rows(data: Any) -> list:
    if isinstance(data, list):
        return data
    lists = [v for v in data.values() if isinstance(v, list)] if isinstance(data, dict) else []
    return lists[0] if len(lists) == 1 else [data]  # {"data": [...]} or a single record


def _read_txt(path: Path) -> datasets.Dataset:
    rows = [{"text": line.rstrip("\r\n"), ORIGIN: f"{path} line {n}"} for n, line in _numbered_lines(path)]
    return _records_from_rows(rows, path)


def _read_parquet(path: Path) -> datasets.Dataset:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from e
    origins = pa.array([f"{path} row {i}" for i in range(1, table.num_rows + 1)], pa.string())
    return datasets.Dataset(datasets.table.InMemoryTable(table.append_column(ORIGIN, origins)))


def decode_line(raw: bytes, where: str, offset: int) -> str:
    """A line of a JSON-lines file as text; bytes that are not UTF-8 are a named error with the byte, its column
    and its offset in the file (`offset`: where the line starts)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}, file offset "
                        f"{offset + e.start}: {e.reason}); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t "
                        f"utf-8)") from None


def _numbered_lines(path: Path):
    """(1-based line number, text) of each non-blank line."""
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = decode_line(raw, f"{path} line {number}", offset)
            offset += len(raw)
            if line.strip():
                yield number, line


def read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8") from None


def _checked_object(record: Any, origin: str) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{origin}: expected a JSON object, got {type(record).__name__}; each record must "
                        f"be an object such as {{\"text\": \"...\"}}")
    return {**record, ORIGIN: origin}


def _records_from_rows(rows: list[dict], path: Path) -> datasets.Dataset:
    # The union of keys (not just the first row's) so a field missing early is not dropped everywhere.
    names = list(dict.fromkeys(key for row in rows for key in row))
    try:
        return datasets.Dataset.from_dict({name: [row.get(name) for row in rows] for name in names})
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise DataError(f"{_first_type_change(rows) or path}: records disagree on a field's type ({e}); "
                        f"give each field one type in every record") from e


def _first_type_change(rows: list[dict]) -> Optional[str]:
    """Origin and field of the first record whose field type differs from earlier records'."""
    seen: dict[str, type] = {}
    for row in rows:
        for name, value in row.items():
            kind = float if isinstance(value, int) and not isinstance(value, bool) else type(value)
            if value is not None and seen.setdefault(name, kind) is not kind:
                return f"{row[ORIGIN]} (field '{name}' is {type(value).__name__})"
    return None


def visible_columns(records: datasets.Dataset) -> list[str]:
    return [c for c in records.column_names if c != ORIGIN]


# --------------------------------------------------------------------------------------------- split


def split_records(records: datasets.Dataset, eval_fraction: float, seed: int, source: str):
    """(train, eval): a seeded random `eval_fraction` of the records is held out (`eval_indices`).

    Both keep file order, so the first problem reported for a split is its earliest in the file; the
    loader shuffles the packed sequences anyway.
    """
    held_out = eval_indices(len(records), eval_fraction, seed, source)
    return records.select(np.setdiff1d(np.arange(len(records)), held_out)), records.select(held_out)


def eval_indices(count: int, eval_fraction: float, seed: int, source: str) -> np.ndarray:
    """The sorted indices (int64) of the records held out for eval among `count`: the first round(count *
    eval_fraction) of a seeded permutation. Only the count is needed, so prepare decides the split while it streams
    the records. The permutation is drawn in uint32 (4 bytes a record, freed on return): numpy's shuffle draws the
    same swaps for any dtype, so it is the permutation `default_rng(seed).permutation(count)` gives."""
    if not 0 < eval_fraction < 1:
        raise DataError(f"{source}: data.eval_fraction is {eval_fraction}; set it in (0, 1) or set "
                        f"data.eval_source")
    n_eval = max(1, round(count * eval_fraction))
    if n_eval >= count:
        raise DataError(f"{source}: only {count} record(s); holding out {n_eval} for eval leaves "
                        f"none to train on; add records, lower data.eval_fraction or set data.eval_source")
    order = np.arange(count, dtype=np.uint32 if count < 1 << 32 else np.int64)
    np.random.default_rng(seed).shuffle(order)
    return np.sort(order[:n_eval]).astype(np.int64)
