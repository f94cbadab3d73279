"""The data pipeline: load records, carve the eval split, tokenize, pack into seq_len blocks, batch.

    tokenizer = load_tokenizer(cfg.model)
    data = build_datasets(cfg.data, tokenizer, seed=cfg.train.seed)     # PreparedData(train, eval, stats)
    loader = MicroBatchLoader(data.train, micro_batch_size, dp_rank, dp_size, seed)

Every problem with the data is a `DataError` whose message names the file and line (or row) and says
how to fix it. To make that possible each loaded record carries an `_origin` column ("path line N")
until the final blocks are built.

Tasks (`DataConfig.task`):
  pretrain  each text + EOS is concatenated and cut into full seq_len blocks; labels = input_ids.
  sft       prompt/response records (loss on response + EOS) or chat `messages` records rendered with
            the tokenizer's chat template (loss on what each assistant message adds). Each sample is
            padded to seq_len, or with `packing` whole samples share blocks (never split).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Optional

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from trainer.config import DataConfig, ModelConfig
from trainer.errors import UserError

IGNORE_INDEX = -100                      # labels the loss skips (torch CrossEntropyLoss default)
ORIGIN = "_origin"                       # per-record "path line N" / "path row N", for error messages
COLUMNS = ("input_ids", "labels", "attention_mask")
FILE_FORMATS = (".jsonl", ".json", ".parquet", ".txt")


class DataError(UserError, ValueError):
    """A problem with the data or its configuration; the message says where and how to fix it.

    A UserError, so the CLI prints it without a traceback; a ValueError for callers that catch those.
    """


# ----------------------------------------------------------------------------------------- tokenizer

def load_tokenizer(model_cfg: ModelConfig):
    """AutoTokenizer from model.tokenizer (else model.name_or_path); pad falls back to EOS."""
    from transformers import AutoTokenizer  # imported here: transformers is slow to import

    path = model_cfg.tokenizer or model_cfg.name_or_path
    if not path:
        raise DataError("model.tokenizer and model.name_or_path are both unset; set model.tokenizer to a "
                        "tokenizer directory (e.g. data/tiny/tokenizer) or a hub id")
    if not Path(path).expanduser().exists() and _looks_like_path(path):
        raise DataError(f"tokenizer {path!r}: no such directory; fix model.tokenizer / model.name_or_path")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load a tokenizer from {path!r}: {e}; check model.tokenizer / "
                        f"model.name_or_path") from e
    if tokenizer.eos_token is None:
        raise DataError(f"tokenizer {path!r} has no eos_token; samples need one to end on")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ------------------------------------------------------------------------------------------- loading

def load_records(source: str, split: str = "train") -> datasets.Dataset:
    """Records from a local .jsonl/.json/.parquet/.txt file, a directory of them, or a hub dataset."""
    if not source:
        raise DataError("data.source is empty; set it to a .jsonl/.json/.parquet/.txt file, a directory "
                        "of them, or a hub dataset name")
    path = Path(source).expanduser()
    if path.exists():
        records = _read_directory(path) if path.is_dir() else _read_file(path)
    elif _looks_like_path(source):
        raise DataError(f"{source}: no such file or directory; fix data.source / data.eval_source")
    else:
        records = _load_hub(source, split)
    if len(records) == 0:
        raise DataError(f"{source}: holds no records; point data.source at a non-empty dataset")
    return records


def _looks_like_path(source: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else that does not exist is a mistyped local path,
    # and so is "dir/name" when dir exists here (asking the hub would only retry and fail offline).
    return (Path(source).suffix in FILE_FORMATS or source.startswith((".", "/", "~"))
            or source.count("/") > 1 or ("/" in source and Path(source).parent.is_dir()))


def _load_hub(name: str, split: str) -> datasets.Dataset:
    try:
        records = datasets.load_dataset(name, split=split)
    except Exception as e:  # the hub raises many types; all mean "cannot use this source"
        raise DataError(f"{name}: not a local path, and loading it as a hub dataset (split {split!r}) "
                        f"failed: {e}") from e
    return records.add_column(ORIGIN, [f"{name} row {i}" for i in range(1, len(records) + 1)])


def _read_directory(directory: Path) -> datasets.Dataset:
    files = sorted(p for p in directory.rglob("*")
                   if p.is_file() and p.suffix in FILE_FORMATS and not p.name.startswith("."))
    if not files:
        raise DataError(f"{directory}: directory holds no {'/'.join(FILE_FORMATS)} files")
    parts = [_read_file(f) for f in files]
    for f, part in zip(files[1:], parts[1:]):
        if set(part.column_names) != set(parts[0].column_names):
            raise DataError(f"{f}: has columns {_visible(part)} but {files[0]} has {_visible(parts[0])}; "
                            f"all files of a directory source must share their columns")
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as e:
        raise DataError(f"{directory}: files disagree on column types ({e}); make each field one type") from e


def _read_file(path: Path) -> datasets.Dataset:
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".txt": _read_txt, ".parquet": _read_parquet}
    if path.suffix not in readers:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use {', '.join(FILE_FORMATS)}")
    return readers[path.suffix](path)


def _read_jsonl(path: Path) -> datasets.Dataset:
    # Parsed here line by line (not by datasets' JSON builder) so errors carry the exact line number.
    rows = []
    for number, line in _numbered_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {number}: invalid JSON at column {e.colno} ({e.msg}); each line "
                            f"must hold one JSON object, e.g. {{\"text\": \"...\"}}") from None
        rows.append(_checked_object(record, f"{path} line {number}"))
    return _records_from_rows(rows, path)


def _read_json(path: Path) -> datasets.Dataset:
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):
            raise DataError(f"{path} line {e.lineno}: invalid JSON at column {e.colno} ({e.msg}); the file "
                            f"must be a JSON array of objects or JSON lines") from None
        return _read_jsonl(path)  # many .json files are really JSON lines
    rows = [_checked_object(r, f"{path} row {i}") for i, r in enumerate(_json_rows(data), 1)]
    return _records_from_rows(rows, path)


def _json_rows(data: Any) -> list:
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


def _numbered_lines(path: Path):
    """(1-based line number, text) of each non-blank line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path} line {number}: not valid UTF-8 ({e.reason}); re-encode the file "
                                f"as UTF-8") from None
            if line.strip():
                yield number, line


def _read_text(path: Path) -> str:
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


def _visible(records: datasets.Dataset) -> list[str]:
    return [c for c in records.column_names if c != ORIGIN]


# --------------------------------------------------------------------------------------------- split

def split_records(records: datasets.Dataset, eval_fraction: float, seed: int, source: str):
    """(train, eval): a seeded random `eval_fraction` of the records is held out.

    Both keep file order, so the first problem reported for a split is its earliest in the file; the
    loader shuffles the packed sequences anyway.
    """
    if not 0 < eval_fraction < 1:
        raise DataError(f"{source}: data.eval_fraction is {eval_fraction}; set it in (0, 1) or set "
                        f"data.eval_source")
    order = np.random.default_rng(seed).permutation(len(records))
    n_eval = max(1, round(len(records) * eval_fraction))
    if n_eval >= len(records):
        raise DataError(f"{source}: only {len(records)} record(s); holding out {n_eval} for eval leaves "
                        f"none to train on; add records, lower data.eval_fraction or set data.eval_source")
    return records.select(np.sort(order[n_eval:])), records.select(np.sort(order[:n_eval]))


# ------------------------------------------------------------------------------------------ tokenize

def record_format(records: datasets.Dataset, data_cfg: DataConfig, tokenizer, source: str) -> str:
    """'text' (pretrain), 'pair' (sft prompt/response) or 'chat' (sft messages)."""
    columns = _visible(records)
    if data_cfg.task == "pretrain":
        if data_cfg.text_field in columns:
            return "text"
        expected = f"'{data_cfg.text_field}' (data.text_field)"
    elif data_cfg.prompt_field in columns and data_cfg.response_field in columns:
        return "pair"
    elif data_cfg.messages_field in columns:
        _check_chat_tokenizer(tokenizer, records, source)
        return "chat"
    else:
        expected = (f"'{data_cfg.prompt_field}' + '{data_cfg.response_field}' (data.prompt_field + "
                    f"data.response_field) or '{data_cfg.messages_field}' (data.messages_field)")
    raise DataError(f"{source}: records (first at {records[0][ORIGIN]}) have columns {columns}, but task "
                    f"'{data_cfg.task}' expects {expected}; rename the fields in the data or set the "
                    f"data.*_field options to the names used")


def _check_chat_tokenizer(tokenizer, records: datasets.Dataset, source: str) -> None:
    where = f"{source}: records (first at {records[0][ORIGIN]}) are chat messages"
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}, but the tokenizer has no chat_template; use a tokenizer with one "
                        f"(model.tokenizer) or convert the records to prompt/response fields")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}, which needs a fast tokenizer (offset mapping) to find assistant tokens")


def tokenize_records(records: datasets.Dataset, fmt: str, data_cfg: DataConfig, tokenizer) -> datasets.Dataset:
    """Per-record input_ids (+ labels for sft), `_cut` (tokens truncated) and `_problem` ('' if fine)."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token; samples need one to end on")
    function = {"text": _tokenize_texts, "pair": _tokenize_pairs, "chat": _tokenize_chats}[fmt]
    samples = records.map(
        partial(function, tokenizer=tokenizer, cfg=data_cfg), batched=True,
        num_proc=data_cfg.num_workers if data_cfg.num_workers > 1 else None,
        remove_columns=_visible(records), desc=f"tokenizing ({fmt})")
    _raise_first_problem(samples)
    return samples


def _tokenize_texts(batch: dict, tokenizer, cfg: DataConfig) -> dict:
    texts, problems = _strings(batch[cfg.text_field], cfg.text_field)
    ids = tokenizer(texts, verbose=False)["input_ids"]
    return {"input_ids": [_with_eos(x, tokenizer.eos_token_id) for x in ids], "_problem": problems}


def _tokenize_pairs(batch: dict, tokenizer, cfg: DataConfig) -> dict:
    prompts, prompt_problems = _strings(batch[cfg.prompt_field], cfg.prompt_field)
    responses, response_problems = _strings(batch[cfg.response_field], cfg.response_field)
    prompt_ids = tokenizer(prompts, verbose=False)["input_ids"]
    response_ids = tokenizer(responses, add_special_tokens=False, verbose=False)["input_ids"]
    out = {"input_ids": [], "labels": [], "_cut": [], "_problem": []}
    problems = [a or b for a, b in zip(prompt_problems, response_problems)]
    for p, r, problem in zip(prompt_ids, response_ids, problems):
        r = _with_eos(r, tokenizer.eos_token_id)
        _append_fitted(out, p + r, [IGNORE_INDEX] * len(p) + r, cfg, problem)
    return out


def _tokenize_chats(batch: dict, tokenizer, cfg: DataConfig) -> dict:
    out = {"input_ids": [], "labels": [], "_cut": [], "_problem": []}
    for messages in batch[cfg.messages_field]:
        try:
            ids, labels = chat_sample(tokenizer, messages)
            _append_fitted(out, ids, labels, cfg, "")
        except DataError as e:  # reported with the record's origin by _raise_first_problem
            _append_fitted(out, [], [], cfg, str(e))
    return out


def chat_sample(tokenizer, messages: Any) -> tuple[list[int], list[int]]:
    """Rendered conversation ids; labels are real only on the tokens each assistant message adds."""
    _check_messages(messages)
    text = _render(tokenizer, messages)
    spans = _assistant_spans(tokenizer, messages, text)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = encoding["input_ids"]
    labels = [t if _overlaps(span, spans) else IGNORE_INDEX for t, span in zip(ids, encoding["offset_mapping"])]
    return ids, labels


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError("messages must be a list of {\"role\": str, \"content\": str} objects")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("no assistant message, so nothing to train on; add one or drop the record")


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # template errors (e.g. "roles must alternate") are the record's problem
        raise DataError(f"chat template failed: {e}") from e


def _assistant_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]]:
    # What message i adds = render(messages[:i+1]) minus render(messages[:i]) + the generation prompt,
    # so the assistant header is context and the content + end-of-turn tokens are learnt.
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        through = _render(tokenizer, messages[:i + 1])
        if not (text.startswith(before) and text.startswith(through)):
            raise DataError("the chat template renders a conversation prefix that is not a prefix of the "
                            "whole conversation, so assistant tokens cannot be located; use prompt/response "
                            "records or a prefix-stable template")
        spans.append((len(before), len(through)))
    return spans


def _overlaps(offsets: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    # A token straddling a boundary (e.g. " 7" after "A:") counts as assistant text.
    start, end = offsets
    return any(start < span_end and max(end, start + 1) > span_start for span_start, span_end in spans)


def _strings(values: list, name: str) -> tuple[list[str], list[str]]:
    """Values with non-strings replaced by '' and a per-value problem ('' when it is a string)."""
    problems = ["" if isinstance(v, str) else f"field '{name}' is {'missing' if v is None else type(v).__name__}"
                f", expected a string" for v in values]
    return [v if isinstance(v, str) else "" for v in values], problems


def _with_eos(ids: list[int], eos_id: int) -> list[int]:
    # Some tokenizers append EOS themselves; never end a sample on two.
    return ids if ids and ids[-1] == eos_id else ids + [eos_id]


def _append_fitted(out: dict, ids: list[int], labels: list[int], cfg: DataConfig, problem: str) -> None:
    cut = max(0, len(ids) - cfg.seq_len)
    if cut and not cfg.truncate and not problem:
        problem = (f"record is {len(ids)} tokens, longer than data.seq_len {cfg.seq_len}; set "
                   f"data.truncate: true to cut it, raise data.seq_len, or shorten the record")
    if cut and cfg.truncate:
        ids, labels = ids[:cfg.seq_len], labels[:cfg.seq_len]
    out["input_ids"].append(ids)
    out["labels"].append(labels)
    out["_cut"].append(cut if cfg.truncate else 0)
    out["_problem"].append(problem)


def _raise_first_problem(samples: datasets.Dataset) -> None:
    problems = _column(samples, "_problem")
    bad = [i for i, problem in enumerate(problems) if problem]
    if bad:
        more = f" ({len(bad) - 1} more record(s) of this split have problems too)" if len(bad) > 1 else ""
        raise DataError(f"{samples[bad[0]][ORIGIN]}: {problems[bad[0]]}{more}")


def _column(dataset: datasets.Dataset, name: str) -> list:
    return dataset.with_format("arrow")[:][name].to_pylist()


# -------------------------------------------------------------------------------------------- blocks

def pack_pretrain(samples: datasets.Dataset, seq_len: int) -> tuple[datasets.Dataset, dict]:
    """Concatenate every sample and cut full seq_len blocks; the short remainder is dropped."""
    flat = pc.list_flatten(samples.with_format("arrow")[:]["input_ids"]).to_numpy().astype(np.int64)
    n_blocks = len(flat) // seq_len
    blocks = flat[:n_blocks * seq_len].reshape(n_blocks, seq_len)
    stats = _block_stats(n_blocks * seq_len, n_blocks, seq_len, label_tokens=n_blocks * seq_len,
                         dropped_tokens=len(flat) - n_blocks * seq_len)
    return blocks_dataset(blocks, blocks, np.ones_like(blocks)), stats


def pack_sft(samples: datasets.Dataset, seq_len: int, packing: bool, pad_id: int) -> tuple[datasets.Dataset, dict]:
    """Pad each sample to seq_len, or with packing place whole samples greedily into shared blocks."""
    ids, labels, cut = _column(samples, "input_ids"), _column(samples, "labels"), _column(samples, "_cut")
    total_tokens = sum(len(x) for x in ids)
    # Truncation can cut away a whole response; such a sample would only add padding-like noise.
    keep = [i for i, lab in enumerate(labels) if any(x != IGNORE_INDEX for x in lab)]
    ids, labels = [ids[i] for i in keep], [labels[i] for i in keep]
    groups = group_samples([len(x) for x in ids], seq_len, packing)
    input_ids, block_labels, mask = _fill_blocks(ids, labels, groups, seq_len, pad_id)
    stats = _block_stats(int(mask.sum()), len(groups), seq_len,
                         label_tokens=int((block_labels != IGNORE_INDEX).sum()),
                         dropped_tokens=total_tokens - int(mask.sum()),
                         truncated_records=sum(1 for c in cut if c), dropped_records=len(cut) - len(keep))
    return blocks_dataset(input_ids, block_labels, mask), stats


def group_samples(lengths: list[int], seq_len: int, packing: bool) -> list[list[int]]:
    """Indices of the samples in each block: one per block, or greedy in order (next fit) with packing."""
    if not packing:
        return [[i] for i in range(len(lengths))]
    groups, current, used = [], [], 0
    for i, length in enumerate(lengths):
        if current and used + length > seq_len:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += length
    return groups + [current] if current else groups


def _fill_blocks(ids: list[list[int]], labels: list[list[int]], groups: list[list[int]], seq_len: int,
                 pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    input_ids = np.full((len(groups), seq_len), pad_id, dtype=np.int64)
    block_labels = np.full((len(groups), seq_len), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(groups), seq_len), dtype=np.int64)
    for row, group in enumerate(groups):
        position = 0
        for i in group:
            end = position + len(ids[i])
            input_ids[row, position:end] = ids[i]
            block_labels[row, position:end] = labels[i]
            mask[row, position:end] = 1
            position = end
    return input_ids, block_labels, mask


def blocks_dataset(input_ids: np.ndarray, labels: np.ndarray, attention_mask: np.ndarray) -> datasets.Dataset:
    """A Dataset of [n, seq_len] int arrays, built through Arrow (no Python lists per token)."""
    n, seq_len = input_ids.shape
    offsets = pa.array(np.arange(0, (n + 1) * seq_len, seq_len, dtype=np.int32), pa.int32())

    def as_lists(array: np.ndarray) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.array(array.reshape(-1).astype(np.int64)))

    table = pa.table({"input_ids": as_lists(input_ids), "labels": as_lists(labels),
                      "attention_mask": as_lists(attention_mask)})
    return datasets.Dataset(datasets.table.InMemoryTable(table))


def _block_stats(tokens: int, sequences: int, seq_len: int, **extra: int) -> dict:
    capacity = sequences * seq_len
    return {"tokens": tokens, "sequences": sequences, "padded_tokens": capacity - tokens,
            "packing_efficiency": tokens / capacity if capacity else 0.0, **extra}


# --------------------------------------------------------------------------------------------- build

@dataclass
class PreparedData:
    train: datasets.Dataset          # columns input_ids, labels, attention_mask: lists of seq_len ints
    eval: datasets.Dataset
    stats: dict = field(default_factory=dict)   # {"train": {...}, "eval": {...}}


def build_datasets(data_cfg: DataConfig, tokenizer, seed: int) -> PreparedData:
    """Tokenized, packed train and eval datasets plus their stats."""
    records = load_records(data_cfg.source, data_cfg.split)
    fmt = record_format(records, data_cfg, tokenizer, data_cfg.source)
    if data_cfg.eval_source:
        eval_records = load_records(data_cfg.eval_source, data_cfg.eval_split or data_cfg.split)
        if record_format(eval_records, data_cfg, tokenizer, data_cfg.eval_source) != fmt:
            raise DataError(f"{data_cfg.eval_source}: eval records have columns {_visible(eval_records)}, "
                            f"a different format from {data_cfg.source}'s {_visible(records)}; use one format")
        train_records = records
    else:
        train_records, eval_records = split_records(records, data_cfg.eval_fraction, seed, data_cfg.source)
    train, train_stats = _prepare_split(train_records, fmt, data_cfg, tokenizer, "train", data_cfg.source)
    eval_source = data_cfg.eval_source or data_cfg.source
    evaluation, eval_stats = _prepare_split(eval_records, fmt, data_cfg, tokenizer, "eval", eval_source)
    return PreparedData(train, evaluation, {"train": train_stats, "eval": eval_stats})


def _prepare_split(records: datasets.Dataset, fmt: str, data_cfg: DataConfig, tokenizer, name: str,
                   source: str) -> tuple[datasets.Dataset, dict]:
    samples = tokenize_records(records, fmt, data_cfg, tokenizer)
    if data_cfg.task == "pretrain":
        blocks, stats = pack_pretrain(samples, data_cfg.seq_len)
    else:
        blocks, stats = pack_sft(samples, data_cfg.seq_len, data_cfg.packing, tokenizer.pad_token_id)
    if len(blocks) == 0:
        raise DataError(f"{source}: the {name} split ({len(records)} records from {records[0][ORIGIN]} on) "
                        f"yields no full {data_cfg.seq_len}-token sequence; add data, lower data.seq_len, "
                        f"raise data.eval_fraction or set data.eval_source")
    return blocks, {"records": len(records), **stats}


# -------------------------------------------------------------------------------------------- loader

class MicroBatchLoader:
    """Endless, deterministic, sharded micro-batches with a resumable position.

    Epoch e visits the sequences in the permutation drawn from (seed, e) (identity without shuffle),
    cut into micro-batches; data-parallel rank r takes micro-batches r, r + dp_size, ... . The tail
    that cannot give every rank a full micro-batch is dropped, so all ranks take the same number of
    steps. Under tensor parallelism pass the data-parallel rank: a TP group then sees the same batch.
    One iterator at a time: iterating advances this loader's own position.
    """

    def __init__(self, dataset: datasets.Dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, shuffle: bool = True):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need micro_batch_size >= 1 and 0 <= dp_rank < dp_size; got "
                             f"{micro_batch_size}, {dp_rank}, {dp_size}")
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self._rows = dataset.with_format("numpy", columns=list(COLUMNS))
        self.epoch, self.batches_in_epoch = 0, 0
        if self.batches_per_epoch() == 0:
            raise DataError(f"{len(dataset)} sequences cannot give each of {dp_size} data-parallel ranks one "
                            f"micro-batch of {micro_batch_size}; add data or lower micro_batch_size/seq_len")

    def batches_per_epoch(self) -> int:
        return len(self._rows) // self.micro_batch_size // self.dp_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        epoch, batch = int(state["epoch"]), int(state["batches_in_epoch"])
        if epoch < 0 or not 0 <= batch <= self.batches_per_epoch():
            raise DataError(f"saved data position {state} does not fit this loader ({self.batches_per_epoch()} "
                            f"batches per epoch); the data, micro_batch_size or data-parallel size changed")
        self._set_position(epoch, batch)

    def __iter__(self):
        while True:
            epoch, start = self.epoch, self.batches_in_epoch
            order = self._epoch_order(epoch)
            for batch in range(start, self.batches_per_epoch()):
                rows = self._rows[self._batch_indices(order, batch).tolist()]
                self._set_position(epoch, batch + 1)  # before yielding: state_dict names the *next* batch
                yield {name: torch.from_numpy(np.asarray(rows[name], dtype=np.int64)) for name in COLUMNS}

    def _set_position(self, epoch: int, batch: int) -> None:
        self.epoch, self.batches_in_epoch = (epoch + 1, 0) if batch == self.batches_per_epoch() else (epoch, batch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self._rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self._rows))

    def _batch_indices(self, order: np.ndarray, batch: int) -> np.ndarray:
        first = (batch * self.dp_size + self.dp_rank) * self.micro_batch_size
        return order[first:first + self.micro_batch_size]
