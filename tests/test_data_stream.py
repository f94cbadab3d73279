"""prepare streams its source (trainer/data/reading.py, encode.py): the shards are the bytes of tokenizing each whole
split at once, whatever the chunks, the shard size or the number of processes; the eval split is the seeded
permutation's; a bad record anywhere is named by file and line and leaves nothing a rerun would trip over.

The speed and memory targets are measured by scripts/bench_data.py, not here.
"""
from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.config import DataConfig, ModelConfig
from trainer.data import DataError, load_records, load_tokenizer
from trainer.data import reading
from trainer.data.encode import AHEAD, Settings, Workers
from trainer.data.prepare import prepare
from trainer.data.records import eval_indices

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the cat sat on a mat while one dog ran to the big red barn and back again é ü 中文 😀 \"q\" \\ \t".split(" ")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(tokenizer=str(ROOT / "data" / "tiny" / "tokenizer")))


def text(i: int) -> str:
    """Mostly short, every 50th long: chunks are cut by their line count and by their bytes."""
    count = 3 + i % 17 if i % 50 else 900
    return f"{i} " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(count))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A directory of every file kind load_records reads, with what trips a line reader: a byte-order mark, blank
    and whitespace-only lines (Unicode whitespace too), CRLF, escapes, no final newline."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps({"text": text(i)}, ensure_ascii=i % 2 == 0)
                                                            + "\n" for i in range(6000)).encode())
    lines = []
    for i in range(6000, 9000):
        lines.append(json.dumps({"text": text(i)}, ensure_ascii=i % 2 == 0))
        lines += [""] if i % 97 == 0 else ["  \u00a0 "] if i % 389 == 0 else []
    (root / "b.jsonl").write_bytes("\n".join(lines).encode() + b"\r\n\n" +
                                   json.dumps({"text": "last, without a newline"}).encode())
    (root / "c.txt").write_text("\n".join(text(i) for i in range(9000, 9700)) + "\n\n  \n", encoding="utf-8")
    pq.write_table(pa.table({"text": [text(i) for i in range(9700, 10300)]}), root / "d.parquet", row_group_size=128)
    (root / "sub").mkdir()
    (root / "sub" / "e.json").write_text(json.dumps([{"text": text(i)} for i in range(10300, 10500)]))
    return root


def config(source: str | Path, tmp_path: Path) -> DataConfig:
    return DataConfig(task="pretrain", source=str(source), seq_len=32, eval_fraction=0.07, split_seed=5,
                      cache_dir=str(tmp_path / "cache"))


def expected_files(records: datasets.Dataset, cfg: DataConfig, tokenizer, per_shard: int) -> dict[str, bytes]:
    """The shards as the whole-corpus path wrote them: every record loaded at once (load_records), the eval split
    drawn from `default_rng(split_seed).permutation(n)`, each split tokenized by `tokenizer(text)` + EOS."""
    order = np.random.default_rng(cfg.split_seed).permutation(len(records))
    held_out = np.sort(order[:max(1, round(len(records) * cfg.eval_fraction))])
    splits = {"train": np.setdiff1d(np.arange(len(records)), held_out), "eval": held_out}
    files = {}
    for name, rows in splits.items():
        for index, start in enumerate(range(0, len(rows), per_shard)):
            chosen = records.select(rows[start:start + per_shard]).to_dict()
            documents = [ids + [tokenizer.eos_token_id] for ids in tokenizer(chosen["text"])["input_ids"]]
            stem = f"{name}/{index:05d}"
            files[f"{stem}.tokens"] = np.array([t for d in documents for t in d], dtype=np.uint16).tobytes()
            files[f"{stem}.docs"] = np.cumsum([len(d) for d in documents]).astype(np.int64).tobytes()
            entry = {"tokens": sum(map(len, documents)), "documents": len(documents),
                     "records": len(documents), "first": chosen["_origin"][0],
                     "files": {suffix: {"bytes": len(files[f"{stem}.{suffix}"]),
                                        "sha256": hashlib.sha256(files[f"{stem}.{suffix}"]).hexdigest()}
                               for suffix in ("tokens", "docs")}}
            files[f"{stem}.json"] = json.dumps(entry, indent=1).encode()
    return files


def shard_files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.glob("*/*")) if not p.name.startswith(".")}


@pytest.mark.slow
@pytest.mark.parametrize("per_shard, num_proc", [(100_000, 1), (777, 2), (50, 1)])
def test_streamed_shards_are_the_bytes_of_the_whole_split_tokenized_at_once(corpus, tmp_path, tokenizer, per_shard,
                                                                            num_proc):
    cfg = config(corpus, tmp_path)
    records = load_records(str(corpus))
    assert len(records) == 10_501 and records[0]["text"] == text(0)  # the byte-order mark is not text
    manifest = prepare(cfg, str(corpus), tokenizer, tmp_path / "out", per_shard, num_proc)
    assert shard_files(tmp_path / "out") == expected_files(records, cfg, tokenizer, per_shard)
    assert manifest["splits"]["eval"]["records"] == round(10_501 * 0.07)


def test_the_eval_split_is_the_seeded_permutations_first_records():
    for count, fraction, seed in [(2, 0.5, 0), (1000, 0.05, 3), (123_457, 0.01, 9)]:
        order = np.random.default_rng(seed).permutation(count)
        wanted = np.sort(order[:max(1, round(count * fraction))])
        assert np.array_equal(eval_indices(count, fraction, seed, "s"), wanted)


@pytest.mark.slow  # 3-9 s in the quick tier's list of tests slower than 2 s (issue 36's 120 s budget)
def test_a_hub_dataset_is_read_in_row_chunks(tmp_path, tokenizer, monkeypatch):
    """The hub is the network (mocked): the dataset `datasets` would cache is read as rows, named by row."""
    table = datasets.Dataset.from_dict({"text": [text(i) for i in range(3000)], "other": list(range(3000))})
    monkeypatch.setattr(reading, "hub_dataset", lambda name, split, subset: table)
    cfg = config("org/corpus", tmp_path)
    prepare(cfg, "org/corpus", tokenizer, tmp_path / "out", 1000, 2)
    records = table.add_column("_origin", [f"org/corpus row {i}" for i in range(1, 3001)])
    assert shard_files(tmp_path / "out") == expected_files(records, cfg, tokenizer, 1000)
    # what a tokenizer process is handed is its chunk's rows, not the table they were cut from
    reader = reading.SourceReader("org/corpus")
    reader.count([])
    handed = [len(pickle.dumps(chunk.payload)) for chunk in reader.chunks(["text"])]
    assert len(handed) > 1 and sum(handed) < 1.2 * len(pickle.dumps(table.data.table.column("text")))


def test_a_bad_record_late_in_the_file_is_named_and_leaves_no_shard(tmp_path, tokenizer):
    """Shards before the bad line were finished; they are removed (the fix changes the source, so they could never be
    continued), and the same output directory prepares the fixed file."""
    source = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": text(i)}) for i in range(3000)]
    source.write_text("\n".join(lines[:2899] + ['{"text": "cut off'] + lines[2900:]) + "\n")
    out = tmp_path / "out"
    with pytest.raises(DataError) as error:
        prepare(config(source, tmp_path), str(source), tokenizer, out, 200, 1)
    assert f"{source} line 2900: invalid JSON" in str(error.value)
    assert not out.exists()
    source.write_text("\n".join(lines) + "\n")
    prepare(config(source, tmp_path), str(source), tokenizer, out, 200, 1)
    assert (out / "manifest.json").is_file()


@pytest.mark.parametrize("record, named", [({"text": 7}, "field 'text' is int, expected a string"),
                                           ({"txt": "x"}, "field 'text' is missing, expected a string"),
                                           (["text"], "expected a JSON object, got list")])
def test_every_record_problem_names_its_file_and_line(tmp_path, tokenizer, record, named):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [{"text": text(i)} for i in range(1500)] + [record]))
    with pytest.raises(DataError, match=f"{source} line 1501: {named}"):
        prepare(config(source, tmp_path), str(source), tokenizer, tmp_path / "out", 100_000, 2)


def test_a_file_that_grows_between_the_two_passes_is_named(tmp_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": text(i)}) + "\n" for i in range(100)))
    stream = reading.SourceReader(str(source))
    assert stream.count([reading.count_lines(task) for task in stream.count_tasks()]) == 100
    with open(source, "a") as f:
        f.write(json.dumps({"text": "appended"}) + "\n")
    with pytest.raises(DataError, match="changed while it was being prepared"):
        list(stream.chunks(["text"]))


def slow_first(task: int) -> int:
    import time
    time.sleep(0.5 if task == 0 else 0.0)
    return task * task


@pytest.mark.slow  # 3-9 s in the quick tier's list of tests slower than 2 s (issue 36's 120 s budget)
def test_the_workers_take_a_bounded_number_of_tasks_ahead_and_answer_in_order(tokenizer):
    drawn = []

    def tasks():
        for task in range(40):
            drawn.append(task)
            yield task

    settings = Settings(tokenizer, DataConfig(), "text", np.dtype(np.uint16))
    with Workers(2, settings) as workers:
        results = workers.ordered(slow_first, tasks())
        first = next(results)
        assert len(drawn) <= AHEAD * 2  # the slow first task holds the rest back: nothing more was read
        assert [first, *results] == [t * t for t in range(40)]


def test_bytes_that_are_not_utf8_are_named_with_line_byte_and_file_offset(tmp_path, tokenizer):
    source = tmp_path / "corpus.jsonl"
    good = "".join(json.dumps({"text": text(i)}) + "\n" for i in range(1500)).encode()
    source.write_bytes(good + b'{"text": "caf\xe9"}\n')
    offset = len(good) + len(b'{"text": "caf')
    with pytest.raises(DataError, match=rf"{source} line 1501: not valid UTF-8 \(byte 0xe9 at column 14, file offset "
                                        rf"{offset}: .*iconv -f latin1 -t utf-8"):
        prepare(config(source, tmp_path), str(source), tokenizer, tmp_path / "out", 100_000, 2)


@pytest.mark.parametrize("odd", ["fifo", "device", "dangling"])
def test_a_data_directory_entry_that_is_not_a_file_is_named_not_skipped(tmp_path, tokenizer, odd):
    """A `.jsonl` in the source directory that is a FIFO, a device or a dangling link was meant as data: silently
    training without it would change the corpus."""
    import os
    source = tmp_path / "corpus"
    source.mkdir()
    (source / "a.jsonl").write_text("".join(json.dumps({"text": text(i)}) + "\n" for i in range(1500)))
    entry = source / "b.jsonl"
    {"fifo": lambda: os.mkfifo(entry), "device": lambda: entry.symlink_to("/dev/zero"),
     "dangling": lambda: entry.symlink_to(tmp_path / "gone.jsonl")}[odd]()
    with pytest.raises(DataError, match=f"{entry}: not a regular file .* in the data directory {source}"):
        prepare(config(source, tmp_path), str(source), tokenizer, tmp_path / "out", 100_000, 2)
    assert not (tmp_path / "out" / "manifest.json").exists()
