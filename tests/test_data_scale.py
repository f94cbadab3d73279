"""Data at pretraining scale: token shards prepared once, read memory-mapped, consumed by global sample index.

Fast tests build small prepared datasets under tmp_path; the multirank ones train tiny_cpu on 2 CPU ranks and
resume on 1. The throughput and memory targets are measured by scripts/bench_data.py, not here.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import STAGES, TINY
from distributed import REPO, last_wins, launch, read_metrics
from trainer.config import DataConfig, ModelConfig, SourceConfig
from trainer.data import DataError, MicroBatchLoader, build_datasets, load_tokenizer
from trainer.data.prepare import prepared_path

TOKENIZER = str(REPO / "data" / "tiny" / "tokenizer")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(tokenizer=TOKENIZER))


def write_corpus(path: Path, documents: int, seed: int = 0) -> str:
    words = np.array("the cat sat on a mat while one dog ran to the big red barn and back again".split())
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(documents):
            f.write(json.dumps({"text": f"{i} " + " ".join(rng.choice(words, rng.integers(5, 40)))}) + "\n")
    return str(path)


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.endswith(".tmp")}


def prepare_cli(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", "prepare-data", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


# --- the prepared format ---------------------------------------------------------------------------

def test_prepared_data_is_uint16_with_a_manifest_and_2_bytes_a_token(tmp_path, tokenizer):
    source = write_corpus(tmp_path / "corpus.jsonl", 3000)
    cfg = DataConfig(source=source, seq_len=32, cache_dir=str(tmp_path / "cache"))
    data = build_datasets(cfg, tokenizer, seed=0)
    root = prepared_path(cfg, source, tokenizer)
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == len(tokenizer) and manifest["task"] == "pretrain"
    assert manifest["tokenizer"]["name"] == TOKENIZER and len(manifest["tokenizer"]["fingerprint"]) == 16
    tokens = manifest["splits"]["train"]["tokens"]
    assert (root / "train" / "00000.tokens").stat().st_size == 2 * tokens
    assert data.stats["train"]["documents"] == manifest["splits"]["train"]["documents"] == 2850


def test_a_second_build_reads_the_cache_without_tokenizing(tmp_path, tokenizer, monkeypatch):
    source = write_corpus(tmp_path / "corpus.jsonl", 500)
    cfg = DataConfig(source=source, seq_len=32, cache_dir=str(tmp_path / "cache"))
    first = build_datasets(cfg, tokenizer, seed=0)
    import trainer.data.prepare as prepare_module
    # every record is read and tokenized by encode_chunk (in this process: data.num_workers is 1): it must stay unused
    monkeypatch.setattr(prepare_module, "encode_chunk", lambda *a, **k: pytest.fail("tokenized again"))
    again = build_datasets(cfg, tokenizer, seed=0)
    ids = np.arange(8)
    assert (first.train.rows(ids)["input_ids"] == again.train.rows(ids)["input_ids"]).all()


def test_the_eval_split_holds_whole_documents_never_seen_in_training(tmp_path, tokenizer):
    source = write_corpus(tmp_path / "corpus.jsonl", 400)
    cfg = DataConfig(source=source, seq_len=8, eval_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    build_datasets(cfg, tokenizer, seed=0)
    root = prepared_path(cfg, source, tokenizer)
    manifest = json.loads((root / "manifest.json").read_text())

    def documents(split):
        tokens = np.fromfile(root / split / "00000.tokens", dtype=np.uint16)
        ends = np.fromfile(root / split / "00000.docs", dtype=np.int64)
        return {tokenizer.decode(doc[:-1]) for doc in np.split(tokens, ends[:-1])}  # without the EOS

    train, held_out = documents("train"), documents("eval")
    assert len(held_out) == manifest["splits"]["eval"]["documents"] == 40 and len(train) == 360
    assert not train & held_out


@pytest.mark.slow
def test_prepare_data_killed_midway_and_rerun_gives_the_same_bytes(tmp_path):
    source = write_corpus(tmp_path / "corpus.jsonl", 60_000)
    common = ["--source", source, "--tokenizer", TOKENIZER, "--records-per-shard", "1000", "--num-proc", "1"]
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert prepare_cli(*common, "--out", str(straight)).wait(timeout=600) == 0
    proc = prepare_cli(*common, "--out", str(interrupted))
    deadline = time.time() + 300
    while not (interrupted / "train" / "00005.json").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (interrupted / "manifest.json").exists(), "the run finished before it could be interrupted"
    kept = {p.name for p in (interrupted / "train").glob("*.json")}
    rerun = prepare_cli(*common, "--out", str(interrupted))
    output, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, output
    assert tree_hashes(interrupted) == tree_hashes(straight)
    assert len(kept) >= 6  # the finished shards were kept, not redone


# --- bad input: a named error before any step --------------------------------------------------------

@pytest.fixture
def prepared(tmp_path, tokenizer):
    source = write_corpus(tmp_path / "corpus.jsonl", 300)
    out = tmp_path / "prepared"
    assert prepare_cli("--source", source, "--tokenizer", TOKENIZER, "--out", str(out)).wait(timeout=300) == 0
    return out


def build_error(cfg: DataConfig, tokenizer) -> str:
    with pytest.raises(DataError) as err:
        build_datasets(cfg, tokenizer, seed=0)
    return str(err.value)


@pytest.mark.slow
def test_a_truncated_or_missing_shard_is_named_at_start(prepared, tokenizer):
    shard = prepared / "train" / "00000.tokens"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    message = build_error(DataConfig(source=str(prepared), seq_len=16), tokenizer)
    assert f"{shard} has {size // 2:,} bytes, the manifest says {size:,}" in message and "prepare it again" in message
    shard.unlink()
    assert f"{shard} is missing" in build_error(DataConfig(source=str(prepared), seq_len=16), tokenizer)


@pytest.mark.slow
def test_data_prepared_with_another_tokenizer_is_refused(prepared, tokenizer):
    from transformers import AutoTokenizer
    other = AutoTokenizer.from_pretrained(TOKENIZER)
    other.add_tokens(["<extra_token>"])
    message = build_error(DataConfig(source=str(prepared), seq_len=16), other)
    assert f"its tokenizer has {len(tokenizer)} tokens, this run's has {len(other)}" in message


@pytest.mark.slow
def test_data_prepared_for_another_task_is_refused(prepared, tokenizer):
    message = build_error(DataConfig(task="sft", source=str(prepared), seq_len=16), tokenizer)
    assert "prepared for task 'pretrain', this run's data.task is 'sft'" in message


@pytest.mark.slow
def test_an_output_directory_that_holds_something_else_is_refused(tmp_path):
    source = write_corpus(tmp_path / "corpus.jsonl", 10)
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = prepare_cli("--source", source, "--tokenizer", TOKENIZER, "--out", str(out))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2 and f"{out} holds other files, not prepared data" in output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_hub_dataset_must_be_prepared_first_and_the_error_says_how(tmp_path, tokenizer):
    message = build_error(DataConfig(source="someorg/somecorpus", cache_dir=str(tmp_path)), tokenizer)
    assert "is a hub dataset" in message and "python -m trainer prepare-data --preset" in message


# --- mixtures ------------------------------------------------------------------------------------------

def test_a_mixture_draws_by_weight_and_keeps_an_eval_split_per_source(tmp_path, tokenizer):
    a, b = write_corpus(tmp_path / "a.jsonl", 800, seed=1), write_corpus(tmp_path / "b.jsonl", 800, seed=2)
    cfg = DataConfig(source="", sources=[SourceConfig(path=a, weight=3.0), SourceConfig(path=b, weight=1.0)],
                     seq_len=16, cache_dir=str(tmp_path / "cache"))
    data = build_datasets(cfg, tokenizer, seed=0)
    assert data.stats["proportions"] == pytest.approx({"a": 0.75, "b": 0.25}, abs=0.01)
    assert [s.sources[0].name for s in data.eval] == ["a", "b"]
    which, _ = data.train.sample_ids(np.arange(10_000))
    assert Counter(which.tolist())[0] / 10_000 == pytest.approx(0.75, abs=0.01)
    loader = MicroBatchLoader(data.train, 4, 0, 1)
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (4, 16)


# --- training: position by global sample index -----------------------------------------------------------

def recorded(run_dir: Path) -> dict[int, Counter]:
    """{step: multiset of row hashes} over every rank and micro-batch of that step."""
    steps: dict[int, Counter] = {}
    for path in run_dir.glob("batches_rank*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            steps.setdefault(row["step"], Counter()).update(row["rows"])
    return steps


def recording_run(out: Path, *extra: str, ranks: int = 2) -> str:
    args = ["tests/workers/train_recording_batches.py", "--preset", "tiny_cpu"]
    for item in last_wins(TINY + STAGES["z0"] + ["train.max_steps=8", "train.save_every=4", "train.eval_every=4",
                                                 f"train.output_dir={out}", *extra]):
        args += ["--set", item]
    return launch(args, ranks=ranks)


@pytest.mark.multirank
def test_a_run_resumed_on_one_rank_trains_on_exactly_the_samples_of_the_two_rank_run(tmp_path):
    """2 ranks x micro 2 for 4 steps, then 1 rank x micro 2 x accumulation 2 from the checkpoint: every step
    consumes the same 4 samples as an uninterrupted 2-rank run (compared by the rows' bytes)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    recording_run(straight, "train.micro_batch_size=2", "train.grad_accum=1")
    recording_run(resumed, "train.micro_batch_size=2", "train.grad_accum=1", "train.stop_after=4")
    output = recording_run(resumed, "train.micro_batch_size=2", "train.grad_accum=2", "hardware.gpus_per_node=1",
                           "train.resume=auto", ranks=1)
    assert "resume: continuing from" in output and "step_00000004" in output
    expected, got = recorded(straight), recorded(resumed)
    assert sorted(got) == sorted(expected) == list(range(1, 9))
    for step in range(1, 9):
        assert got[step] == expected[step] and sum(got[step].values()) == 4, step
    straight_loss = {r["step"]: r["loss"] for r in read_metrics(straight)[0]}
    resumed_loss = {r["step"]: r["loss"] for r in read_metrics(resumed)[0]}
    for step in range(5, 9):  # the same samples and weights: the same loss, up to summation order
        assert resumed_loss[step] == pytest.approx(straight_loss[step], rel=1e-4), step
