"""The tokenizer processes of `prepare`: a chunk of records in (trainer/data/reading.py), each split's token ids out,
as compact arrays, to the parent, which writes them into shards (trainer/data/shards.py).

The processes are forked once per preparation, with the tokenizer and settings already in place (nothing of them is
pickled), and are handed one chunk at a time: at most AHEAD chunks per process are in flight, so memory does not
depend on the corpus or the shard size, and results are taken in order, so the bytes never depend on the number of
processes. They ignore SIGINT: Ctrl-C reaches every process of the terminal's group, and the parent stops them and
reports it once.
"""
from __future__ import annotations

import itertools
import os
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from .. import text
from ..config import DataConfig
from .reading import Chunk, chunk_records
from .records import IGNORE_INDEX, DataError
from .preference import tokenize_preferences
from .tokenize import tokenize_chats, tokenize_pairs

AHEAD = 4              # tasks handed out per process: one process may take a while (a busy machine deschedules
                       # it) before the others run out of work, and in-flight memory stays a few chunks a process
TRAIN, EVAL = 0, 1     # a record's route: its split,
SKIPPED = 2            # plus SKIPPED when its shard was finished by an earlier run (then it is not even parsed)


@dataclass
class Settings:
    """What the tokenizer processes tokenize with (handed to each at its start)."""
    tokenizer: object
    cfg: DataConfig
    fmt: str              # "text", "pair", "chat", "preference" or "preference_chat" (tokenize.record_format)
    dtype: np.dtype       # of the ids on disk

    @property
    def fields(self) -> list[str]:
        cfg = self.cfg
        return {"text": [cfg.text_field], "pair": [cfg.prompt_field, cfg.response_field],
                "chat": [cfg.messages_field],
                "preference": [cfg.prompt_field, cfg.chosen_field, cfg.rejected_field],
                "preference_chat": [cfg.messages_field, cfg.chosen_field, cfg.rejected_field]}[self.fmt]


@dataclass
class Part:
    """The records of one chunk that go to one split, in order (those of finished shards left out)."""
    count: int                      # records of the chunk in this split, skipped ones included
    origin: str                     # a record's origin is f"{origin} {number}"
    numbers: np.ndarray             # each record's line or row number
    lengths: np.ndarray             # tokens each record adds (0: dropped, SFT: no label left after truncation)
    ids: np.ndarray                 # the ids of the records back to back, in the shards' dtype
    mask: Optional[np.ndarray]      # SFT: uint8, 1 where the token is learnt
    cut: Optional[np.ndarray]       # SFT: tokens truncated from each record
    firsts: Optional[np.ndarray] = None  # preference: tokens of each record's first document (chosen; the
                                         # rest of the record is the rejected one)


_SETTINGS: Optional[Settings] = None  # what this process tokenizes with (a tokenizer process: set at its start)


def encode_chunk(task: tuple[Chunk, np.ndarray]) -> dict[int, Part]:
    """The chunk's records tokenized, by split; `routes`: each record's split, plus SKIPPED."""
    chunk, routes = task
    settings = _SETTINGS
    wanted = routes < SKIPPED
    numbers, records = chunk_records(chunk, wanted)
    columns = {field: [record.get(field) for record in records] for field in settings.fields}
    where = Origins(chunk.origin, numbers)
    check_texts(columns, where)
    firsts = None
    if settings.fmt == "text":
        lengths, ids, mask, cut = _encode_texts(columns[settings.cfg.text_field], where, settings)
    elif settings.fmt.startswith("preference"):
        lengths, ids, mask, cut, firsts = _encode_pairs(columns, where, settings)
    else:
        lengths, ids, mask, cut = _encode_samples(columns, where, settings)
    split_of = routes[wanted]
    numbers = np.asarray(numbers, dtype=np.int64)
    parts = {}
    for split in (TRAIN, EVAL):
        chosen = split_of == split
        every = bool(chosen.all())
        tokens = None if every else np.repeat(chosen, lengths)
        parts[split] = Part(int(((routes & 1) == split).sum()), chunk.origin, numbers[chosen], lengths[chosen],
                            ids if every else ids[tokens], mask if mask is None or every else mask[tokens],
                            None if cut is None else cut[chosen], None if firsts is None else firsts[chosen])
    return parts


def check_texts(columns: dict[str, list], where: "Origins") -> None:
    """Every string of the chunk that goes to the tokenizer passes the one text gate (trainer/text.py)."""
    for field, values in columns.items():
        for i, value in enumerate(values):
            message = text.refusal(value, where[i], field)
            if message:
                raise DataError(message)


class Origins:
    """"path line N" of the chunk's i-th record, made only for an error."""

    def __init__(self, origin: str, numbers: list[int]):
        self.origin, self.numbers = origin, numbers

    def __getitem__(self, i: int) -> str:
        return f"{self.origin} {self.numbers[i]}"


def _encode_texts(texts: list, where: Origins, settings: Settings):
    """Pretraining: each text's ids + EOS (never two), as `tokenizer(texts)` gives them, back to back."""
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise DataError(f"{where[i]}: field '{settings.cfg.text_field}' is "
                            f"{'missing' if text is None else type(text).__name__}, expected a string")
    eos, flat = settings.tokenizer.eos_token_id, []
    lengths = np.empty(len(texts), dtype=np.int64)
    for i, ids in enumerate(_encode(settings.tokenizer, texts, where)):
        flat += ids
        if not ids or ids[-1] != eos:  # some tokenizers append EOS themselves: never end on two (with_eos)
            flat.append(eos)
        lengths[i] = len(flat)
    return np.diff(lengths, prepend=0), np.array(flat, dtype=settings.dtype), None, None


def _encode(tokenizer, texts: list[str], where: Origins) -> list[list[int]]:
    """The ids of each text; a text the tokenizer cannot take (e.g. a lone surrogate from a JSON escape) is named.
    A fast tokenizer runs its Rust `encode_batch_fast` (no character offsets: the same ids, ~10% sooner) or
    `encode_batch`: what its __call__ runs, minus building a BatchEncoding of Python lists."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        if not texts:
            return []
        if backend is not None:
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=True)]
        return tokenizer(texts, verbose=False)["input_ids"]
    except Exception:  # noqa: BLE001 - the Rust tokenizer raises bare exceptions: find the record
        for i, text in enumerate(texts):
            try:
                tokenizer(text, verbose=False)
            except Exception as e:  # noqa: BLE001
                raise DataError(f"{where[i]}: the tokenizer cannot encode this text ({type(e).__name__}: {e})") \
                    from None
        raise


def _encode_samples(columns: dict, where: Origins, settings: Settings):
    """SFT: prompt/response or chat samples fitted to seq_len (tokenize.py); a record whose labels are all
    IGNORE_INDEX after truncation is dropped (length 0), the first record with a problem is an error."""
    cfg, tokenizer = settings.cfg, settings.tokenizer
    function = tokenize_pairs if settings.fmt == "pair" else tokenize_chats
    samples = function(columns, tokenizer=tokenizer, cfg=cfg)
    bad = [i for i, problem in enumerate(samples["_problem"]) if problem]
    if bad:
        more = f" ({len(bad) - 1} more record(s) of this batch have problems too)" if len(bad) > 1 else ""
        raise DataError(f"{where[bad[0]]}: {samples['_problem'][bad[0]]}{more}")
    lengths = np.fromiter(map(len, samples["input_ids"]), dtype=np.int64, count=len(samples["input_ids"]))
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(samples["input_ids"]), dtype=np.int64, count=total)
    labels = np.fromiter(itertools.chain.from_iterable(samples["labels"]), dtype=np.int64, count=total)
    learnt = labels != IGNORE_INDEX
    learnt_per_record = np.diff(np.concatenate(([0], np.cumsum(learnt)))[np.concatenate(([0], np.cumsum(lengths)))])
    keep = learnt_per_record > 0  # truncation can cut away a whole response: such a sample only adds noise
    tokens = np.repeat(keep, lengths)
    return (np.where(keep, lengths, 0), ids[tokens].astype(settings.dtype), learnt[tokens].astype(np.uint8),
            np.asarray(samples["_cut"], dtype=np.int64))


def _encode_pairs(columns: dict, where: Origins, settings: Settings):
    """Preference: each record's chosen then rejected sequence (trainer/data/preference.py), back to back; the first
    record with a problem is an error (a pair is never dropped: its two sequences belong together)."""
    pairs = tokenize_preferences(columns, settings.tokenizer, settings.cfg, settings.fmt == "preference_chat")["pairs"]
    bad = [i for i, pair in enumerate(pairs) if pair.problem]
    if bad:
        more = f" ({len(bad) - 1} more record(s) of this batch have problems too)" if len(bad) > 1 else ""
        raise DataError(f"{where[bad[0]]}: {pairs[bad[0]].problem}{more}")
    ids, labels, firsts, lengths = [], [], [], []
    for pair in pairs:
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = pair.sequences()
        ids += chosen_ids + rejected_ids
        labels += chosen_labels + rejected_labels
        firsts.append(len(chosen_ids))
        lengths.append(len(chosen_ids) + len(rejected_ids))
    learnt = np.asarray(labels, dtype=np.int64) != IGNORE_INDEX
    return (np.asarray(lengths, dtype=np.int64), np.asarray(ids, dtype=settings.dtype), learnt.astype(np.uint8),
            np.asarray([pair.cut for pair in pairs], dtype=np.int64), np.asarray(firsts, dtype=np.int64))


# --- the processes ---------------------------------------------------------------------------------

class Workers:
    """`num_proc` processes (none for 1: the work runs here) that map a function over tasks in order."""

    def __init__(self, num_proc: int, settings: Settings):
        self.num_proc, self.settings, self.pool = max(1, num_proc), settings, None

    def __enter__(self) -> "Workers":
        global _SETTINGS
        _SETTINGS = self.settings
        if self.num_proc > 1:
            # Not forked from this process: it may hold threads (pyarrow's allocator, the Rust tokenizer's pool, a
            # caller's), and a fork copies their locks held, so a child could wait on one for ever (seen: a
            # tokenizer process hung in a futex, its test with it). The fork server is a clean single-threaded
            # process; the settings travel pickled.
            import multiprocessing
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__])
            self.pool = context.Pool(self.num_proc, initializer=_worker_start, initargs=(self.settings,))
        return self

    def __exit__(self, *exc) -> None:
        global _SETTINGS
        _SETTINGS = None
        if self.pool is not None:
            self.pool.terminate()  # after an error or Ctrl-C nothing they still do is wanted; otherwise they idle
            self.pool.join()

    def ordered(self, function: Callable, tasks: Iterable) -> Iterator:
        """function(task) for each task, in the order of the tasks, with at most AHEAD tasks per process handed out
        (the tasks are drawn from the iterable only as they go out; the results wait to be taken in order)."""
        if self.pool is None:
            yield from map(function, tasks)
            return
        pending: deque = deque()
        for task in tasks:
            pending.append(self.pool.apply_async(function, (task,)))
            if len(pending) >= AHEAD * self.num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _worker_start(settings: Settings) -> None:
    """Each process is one core's worth of tokenizing (the Rust tokenizer would otherwise start a thread per core
    in every process); Ctrl-C is left to the parent (no traceback per process)."""
    global _SETTINGS
    _SETTINGS = settings
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
