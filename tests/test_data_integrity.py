"""Prepared data is what its manifest says (issue 22): every attack is a named error before the first step.

Each test prepares the shipped tiny corpus (data/tiny/pretrain.jsonl, a copy: the cache key is the source's path and
content) with the tiny tokenizer into a cache of its own, attacks it as a user or another user could, and asserts
the DataError that names the file, what differs and the fix. The last test trains on 2 real DeepSpeed ranks.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY
from distributed import REPO, launch_raw
from trainer.config import DataConfig, ModelConfig
from trainer.data import DataError, build_datasets, load_tokenizer
from trainer.cache import contents as fingerprint
from trainer.data.prepare import prepare, prepared_path

CORPUS = REPO / "data" / "tiny" / "pretrain.jsonl"
TOKENIZER = REPO / "data" / "tiny" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER)))


def config(source: Path, cache: Path, **overrides) -> DataConfig:
    return DataConfig(task="pretrain", source=str(source), seq_len=64, eval_fraction=0.05, cache_dir=str(cache),
                      **overrides)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tokenizer):
    """The tiny corpus prepared once into a cache; each test attacks its own copy of that cache."""
    root = tmp_path_factory.mktemp("pristine")
    source = root / "pretrain.jsonl"
    shutil.copyfile(CORPUS, source)
    build_datasets(config(source, root / "cache"), tokenizer, seed=0)
    return source, root / "cache"


@pytest.fixture
def cached(pristine, tmp_path, tokenizer):
    """(config, cache entry) of this test's own copy of the prepared cache."""
    source, cache = pristine
    shutil.copytree(cache, tmp_path / "cache", symlinks=True)
    cfg = config(source, tmp_path / "cache")
    entry = prepared_path(cfg, str(source), tokenizer)
    assert entry.parent == tmp_path / "cache" and (entry / "manifest.json").is_file()
    return cfg, entry


def refusal(cfg: DataConfig, tokenizer) -> str:
    with pytest.raises(DataError) as err:
        build_datasets(cfg, tokenizer, seed=0)
    return str(err.value)


def load_json(path: Path) -> dict:
    return json.loads(path.read_text())


def rewrite_recorded(entry: Path, split: str, kind: str, data: bytes) -> Path:
    """Write a shard file and record its new SHA-256 in the manifest and the shard's marker: an attacker who keeps
    the record consistent, so that only the values themselves can give the file away."""
    import hashlib
    path = entry / split / f"00000.{kind}"
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    manifest = load_json(entry / "manifest.json")
    manifest["splits"][split]["shards"][0]["files"][kind]["sha256"] = digest
    (entry / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    marker = entry / split / "00000.json"
    written = load_json(marker)
    written["files"][kind]["sha256"] = digest
    marker.write_text(json.dumps(written, indent=1))
    return path


# --- intact data ---------------------------------------------------------------------------------------------------

def test_intact_prepared_data_is_read_once_and_counted(cached, tokenizer):
    cfg, entry = cached
    data = build_datasets(cfg, tokenizer, seed=0)
    shard_files = [p for p in entry.rglob("*") if p.suffix in (".tokens", ".docs")]
    verified = data.stats["verified"]
    assert verified["files"] == len(shard_files) == 4
    assert verified["bytes"] == verified["read_here"] == sum(p.stat().st_size for p in shard_files)


# --- the bytes -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["tokens", "docs"])
def test_a_same_size_rewrite_of_a_shard_is_refused(cached, tokenizer, kind):
    cfg, entry = cached
    shard = entry / "train" / f"00000.{kind}"
    dtype = np.uint16 if kind == "tokens" else np.int64
    values = np.fromfile(shard, dtype=dtype)
    values[:200] = values[:200][::-1]  # every id still in the vocabulary, every size as recorded
    values.tofile(shard)
    message = refusal(cfg, tokenizer)
    assert f"prepared data {entry} is not what its manifest says" in message
    assert f"{shard} has SHA-256" in message and "the size matches: its bytes were changed after preparation" in message
    assert f"prepare it again: delete {entry} (the automatic cache of {cfg.source}" in message


def test_a_same_size_rewrite_in_a_prepared_directory_the_user_named_is_refused(tmp_path, tokenizer):
    source = tmp_path / "pretrain.jsonl"
    shutil.copyfile(CORPUS, source)
    out = tmp_path / "prepared"
    prepare(config(source, tmp_path / "cache"), str(source), tokenizer, out, records_per_shard=1000)
    shard = out / "train" / "00002.tokens"
    values = np.fromfile(shard, dtype=np.uint16)
    values.sort()
    values.tofile(shard)
    message = refusal(config(out, tmp_path / "cache"), tokenizer)
    assert f"{shard} has SHA-256" in message
    assert "prepare it again (`python -m trainer prepare-data --source SOURCE --out NEW_DIR`)" in message


def test_a_token_id_outside_the_vocabulary_is_named_by_shard_and_offset(cached, tokenizer):
    cfg, entry = cached
    values = np.fromfile(entry / "train" / "00000.tokens", dtype=np.uint16)
    values[1234] = len(tokenizer) + 5
    shard = rewrite_recorded(entry, "train", "tokens", values.tobytes())
    message = refusal(cfg, tokenizer)
    assert (f"{shard}: token id {len(tokenizer) + 5:,} at offset 1,234 (byte 2,468) is outside the vocabulary of "
            f"{len(tokenizer):,} tokens") in message
    assert "SHA-256" not in message  # the record was kept consistent: the ids themselves give it away


def test_document_ends_that_run_backwards_or_past_the_shard_are_named(cached, tokenizer):
    cfg, entry = cached
    ends = np.fromfile(entry / "eval" / "00000.docs", dtype=np.int64)
    backwards = ends.copy()
    backwards[5] = backwards[3]
    shard = rewrite_recorded(entry, "eval", "docs", backwards.tobytes())
    assert f"{shard}: document end {ends[3]:,} at entry 5 is before the end of the document before it" \
        in refusal(cfg, tokenizer)
    past = ends.copy()
    past[-1] += 1000  # would read past the shard's tokens
    rewrite_recorded(entry, "eval", "docs", past.tobytes())
    assert f"{shard}: the last document ends at token {past[-1]:,}, the shard has {ends[-1]:,} tokens" \
        in refusal(cfg, tokenizer)


# --- the record ----------------------------------------------------------------------------------------------------

def test_a_manifest_with_a_smaller_token_count_is_refused(cached, tokenizer):
    cfg, entry = cached
    manifest = load_json(entry / "manifest.json")
    train = manifest["splits"]["train"]
    shard = train["shards"][0]
    tokens, size = shard["tokens"], shard["files"]["tokens"]["bytes"]
    shard["tokens"] -= 1000
    train["tokens"] -= 1000
    (entry / "manifest.json").write_text(json.dumps(manifest))
    message = refusal(cfg, tokenizer)
    assert (f"(train shard 0) records {size:,} bytes of tokens for {tokens - 1000:,} tokens in "
            f"{shard['documents']:,} documents; those counts take {size - 2000:,}") in message
    assert f"{entry / 'train' / '00000.json'} does not say what the manifest says of this shard" in message


def test_another_corpus_filed_under_this_runs_key_is_refused(cached, tokenizer, tmp_path):
    cfg, entry = cached
    other = tmp_path / "other.jsonl"
    other.write_text("".join(reversed(CORPUS.read_text().splitlines(keepends=True))))
    other_cfg = config(other, tmp_path / "cache")
    build_datasets(other_cfg, tokenizer, seed=0)
    other_entry = prepared_path(other_cfg, str(other), tokenizer)
    shutil.rmtree(entry)
    shutil.copytree(other_entry, entry)  # intact, consistent prepared data -- of another corpus
    message = refusal(cfg, tokenizer)
    assert f"{entry / 'manifest.json'} records another source than this run's key {entry.name} stands for" in message
    assert f"delete {entry}" in message


# --- the directory entries -----------------------------------------------------------------------------------------

def test_a_shard_replaced_by_a_link_out_of_the_cache_is_refused(cached, tokenizer, tmp_path):
    cfg, entry = cached
    shard = entry / "train" / "00000.tokens"
    outside = tmp_path / "elsewhere.tokens"
    shutil.copyfile(shard, outside)  # the very same bytes: only the link gives it away
    shard.unlink()
    shard.symlink_to(outside)
    assert f"{shard} is a symbolic link to {outside}: the cache writes none" in refusal(cfg, tokenizer)


def test_a_cache_entry_that_is_a_link_is_refused(cached, tokenizer, tmp_path):
    cfg, entry = cached
    moved = tmp_path / "moved"
    entry.rename(moved)
    entry.symlink_to(moved)  # an intact copy, but anyone who can rename the link chooses what trains
    assert f"{entry} is a symbolic link to {moved}: the cache holds directories, never links" in refusal(cfg, tokenizer)


def test_a_link_out_of_a_prepared_directory_the_user_named_is_refused(tmp_path, tokenizer):
    source = tmp_path / "pretrain.jsonl"
    shutil.copyfile(CORPUS, source)
    out = tmp_path / "prepared"
    prepare(config(source, tmp_path / "cache"), str(source), tokenizer, out, records_per_shard=100_000)
    shard, outside = out / "eval" / "00000.docs", tmp_path / "outside.docs"
    shutil.copyfile(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    message = refusal(config(out, tmp_path / "cache"), tokenizer)
    assert f"{shard} is a symbolic link to {outside}, outside {out.resolve()}" in message


def give_away(path: Path, uid: int = 12345) -> None:
    try:
        os.chown(path, uid, uid, follow_symlinks=False)
    except PermissionError:
        pytest.skip("giving a file to another user needs root")


def test_a_cache_entry_owned_by_another_user_is_refused_unless_trusted(cached, tokenizer):
    cfg, entry = cached
    for path in [entry, *entry.rglob("*")]:
        give_away(path)
    message = refusal(cfg, tokenizer)
    assert f"{entry} belongs to user id 12345, not to you ({os.getuid()})" in message
    assert "for a cache shared with people you trust, set data.trust_shared_cache=true" in message
    trusted = build_datasets(dataclasses.replace(cfg, trust_shared_cache=True), tokenizer, seed=0)
    assert len(trusted.train) > 0


def test_one_foreign_or_world_writable_file_in_a_cache_entry_is_refused(cached, tokenizer):
    cfg, entry = cached
    shard = entry / "eval" / "00000.tokens"
    give_away(shard)
    assert f"{shard} belongs to user id 12345" in refusal(cfg, tokenizer)
    os.chown(shard, os.getuid(), os.getgid())
    shard.chmod(0o666)
    trusting = dataclasses.replace(cfg, trust_shared_cache=True)
    assert f"{shard} can be written by every user (mode -rw-rw-rw-)" in refusal(trusting, tokenizer)


def test_a_world_writable_cache_directory_without_the_sticky_bit_is_refused(cached, tokenizer):
    cfg, entry = cached
    entry.parent.chmod(0o777)
    assert "can be written by every user and has no sticky bit" in refusal(cfg, tokenizer)
    entry.parent.chmod(0o1777)  # as /tmp: nobody can rename another user's entry
    assert len(build_datasets(cfg, tokenizer, seed=0).train) > 0


@pytest.mark.parametrize("victim_holds", [["thesis.tex"], []], ids=["a victims directory", "an empty directory"])
def test_a_planted_temporary_link_is_not_followed(tmp_path, tokenizer, victim_holds):
    """prepare_into_cache once prepared into `.<key>.<pid>.tmp` after an rmtree of that name: a link planted there (a
    shared cache directory) led the shards into the directory it names -- a victim's, or an empty one of the
    attacker's, which then became the cache entry (renamed link and all) for the attacker to rewrite at will."""
    source = tmp_path / "pretrain.jsonl"
    shutil.copyfile(CORPUS, source)
    cfg = config(source, tmp_path / "cache")
    entry = prepared_path(cfg, str(source), tokenizer)
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in victim_holds:
        (victim / name).write_text("years of work")
    entry.parent.mkdir()
    planted = entry.parent / f".{entry.name}.{os.getpid()}.tmp"
    planted.symlink_to(victim)
    data = build_datasets(cfg, tokenizer, seed=0)
    assert len(data.train) > 0
    assert sorted(p.name for p in victim.iterdir()) == victim_holds
    assert all((victim / name).read_text() == "years of work" for name in victim_holds)
    assert planted.is_symlink() and os.readlink(planted) == str(victim)
    assert entry.is_dir() and not entry.is_symlink()
    leftovers = [p.name for p in entry.parent.iterdir() if p.name.endswith(".tmp") and p != planted]
    assert leftovers == []


def test_a_file_replaced_after_the_check_is_not_read(cached, tokenizer):
    cfg, entry = cached
    data = build_datasets(cfg, tokenizer, seed=0)
    shard = entry / "train" / "00000.tokens"
    replacement = shard.with_name("replacement")
    shutil.copyfile(shard, replacement)
    os.replace(replacement, shard)  # same bytes, another file: not the one that was checked
    with pytest.raises(DataError, match="is no longer the file that was verified when this run started"):
        data.train.rows(np.arange(2))


# --- the cache key: the source's content ---------------------------------------------------------------------------

@pytest.mark.slow
def test_a_source_edited_with_its_mtime_kept_is_prepared_again(tmp_path, tokenizer, monkeypatch):
    source = tmp_path / "pretrain.jsonl"
    shutil.copyfile(CORPUS, source)
    time.sleep(1.1)  # a hash is remembered only for a file whose ctime is a second old (fingerprint.SETTLED_NS)
    cfg = config(source, tmp_path / "cache")
    first = build_datasets(cfg, tokenizer, seed=0)
    first_entry = prepared_path(cfg, str(source), tokenizer)
    memo = list((tmp_path / "cache").glob(f".sources-{os.getuid()}/*.json"))
    assert len(memo) == 1 and load_json(memo[0])["files"]["pretrain.jsonl"][4] == fingerprint.sha256_file(source)

    # unchanged: the memo vouches for the source by stat, nothing is read or prepared again
    import trainer.data.build as build_module
    monkeypatch.setattr(fingerprint, "sha256_file", lambda path: pytest.fail(f"{path} was read again"))
    monkeypatch.setattr(build_module, "prepare_into_cache", lambda *a, **k: pytest.fail("prepared again"))
    build_datasets(cfg, tokenizer, seed=0)
    monkeypatch.undo()

    # edited in place, same size, mtime put back (`touch -r`): the ctime moved, so the source is read again
    before = source.stat()
    text = source.read_text()
    assert text.count("cat") > 10
    source.write_text(text.replace("cat", "owl"))
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert source.stat().st_size == before.st_size and source.stat().st_mtime_ns == before.st_mtime_ns
    second = build_datasets(cfg, tokenizer, seed=0)
    second_entry = prepared_path(cfg, str(source), tokenizer)
    assert second_entry != first_entry and (first_entry / "manifest.json").is_file()
    [owl], [cat] = (tokenizer(word, add_special_tokens=False)["input_ids"] for word in (" owl", " cat"))
    before_edit = first.train.sources[0].samples.split.read(0, 20_000)
    trained_on = second.train.sources[0].samples.split.read(0, 20_000)
    assert (before_edit == cat).sum() > 10 and not (trained_on == cat).any()
    assert np.array_equal(trained_on, np.where(before_edit == cat, owl, before_edit))  # the edit, token for token


def test_a_touched_source_keeps_its_cache_entry(tmp_path, tokenizer, monkeypatch):
    source = tmp_path / "pretrain.jsonl"
    shutil.copyfile(CORPUS, source)
    cfg = config(source, tmp_path / "cache")
    build_datasets(cfg, tokenizer, seed=0)
    entry = prepared_path(cfg, str(source), tokenizer)
    os.utime(source, ns=(1, 1))  # a copy or a touch: new stat, same bytes
    import trainer.data.build as build_module
    monkeypatch.setattr(build_module, "prepare_into_cache", lambda *a, **k: pytest.fail("prepared again"))
    build_datasets(cfg, tokenizer, seed=0)
    assert prepared_path(cfg, str(source), tokenizer) == entry


# --- 2 real ranks --------------------------------------------------------------------------------------------------

def launch_tiny_cpu(overrides: list[str]) -> tuple[int, str]:
    args = ["train.py", "--preset", "tiny_cpu"]
    for item in overrides:
        args += ["--set", item]
    return launch_raw(args, timeout=600)


@pytest.mark.multirank
def test_a_swapped_shard_stops_every_rank_of_a_2_rank_run_before_its_first_step(pristine, tmp_path):
    from trainer.data import apply_chat_template
    from trainer.presets import load_preset
    source, _ = pristine
    out, cache = tmp_path / "run", tmp_path / "cache"
    overrides = TINY + [f"data.source={source}", f"data.cache_dir={cache}", f"train.output_dir={out}"]
    cfg = load_preset("tiny_cpu", overrides)
    run_tokenizer = apply_chat_template(load_tokenizer(cfg.model), cfg.data)
    build_datasets(cfg.data, run_tokenizer, seed=0)  # the cache entry the run will look for
    entry = prepared_path(cfg.data, str(source), run_tokenizer)
    shard = entry / "train" / "00000.tokens"
    values = np.fromfile(shard, dtype=np.uint16)
    np.random.default_rng(0).shuffle(values)  # another "corpus" of the same size and vocabulary
    values.tofile(shard)
    code, output = launch_tiny_cpu(overrides)
    assert code != 0, output[-3000:]
    refusals = [line for line in output.splitlines()
                if f"error: prepared data {entry} is not what its manifest says" in line]
    assert len(refusals) == 2, output[-6000:]  # every rank, not one rank and a hang
    assert f"{shard} has SHA-256" in output
    assert not (out / "config.resolved.yaml").exists()


@pytest.mark.multirank
def test_a_source_rank_0_cannot_prepare_stops_every_rank(tmp_path):
    """rank0_first: rank 0 prepares while the others wait; its error is every rank's (they do not wait for it in
    a later collective, or prepare the same source again)."""
    source = tmp_path / "corpus.jsonl"
    lines = CORPUS.read_text().splitlines(keepends=True)
    lines[6] = '{"text": "cut off\n'
    source.write_text("".join(lines))
    out = tmp_path / "run"
    code, output = launch_tiny_cpu(TINY + [f"data.source={source}", f"data.cache_dir={tmp_path / 'cache'}",
                                           f"train.output_dir={out}"])
    assert code != 0, output[-3000:]
    refusals = [line for line in output.splitlines() if f"error: {source} line 7: invalid JSON" in line]
    assert len(refusals) == 2, output[-6000:]
    assert not (out / "config.resolved.yaml").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".sources")] == []
