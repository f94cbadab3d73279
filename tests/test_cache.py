"""The cache layer (trainer/cache), by drawn cases: keys follow content (never a name), a model's identity moves
with any byte of its files or its hub ref and is hashed once, and every entry is refused, with the file named, when
it is a link, another user's, world-writable, or holds another dtype, shape or a value that is not finite; a file
is never written through a planted name. Reference log-probs keys (trainer/train/reference_logps.py) are checked
here for what decides them; the runs that start at ln 2 are in tests/test_preference_engine.py."""
from __future__ import annotations

import json
import os
import random
import string
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hub_cache import commit_id, make_hub_cache
from trainer.cache import contents, entries, keys, weights
from trainer.cache.errors import CacheError
from trainer.config import ModelConfig
from trainer.train import reference_logps

DRAWS = 40


def draw_bytes(draw: random.Random, low: int = 1, high: int = 200) -> bytes:
    return bytes(draw.randrange(256) for _ in range(draw.randint(low, high)))


def draw_name(draw: random.Random) -> str:
    return "".join(draw.choice(string.ascii_lowercase) for _ in range(draw.randint(1, 8)))


def draw_manifest(draw: random.Random) -> dict:
    """A prepared-data manifest's fields a reference key reads, with drawn shard contents."""
    shards = [{"tokens": draw.randint(1, 10_000), "documents": 2 * draw.randint(1, 50),
               "files": {kind: {"sha256": draw_bytes(draw, 32, 32).hex(), "bytes": 1} for kind in
                         ("tokens", "docs", "labels")}} for _ in range(draw.randint(1, 3))]
    return {"task": "preference", "dtype": "uint16", "tokenizer": {"fingerprint": "t" * 16},
            "splits": {"train": {"shards": shards}, "eval": {"shards": shards[:1]}}}


RUN = SimpleNamespace(data=SimpleNamespace(seq_len=64), train=SimpleNamespace(precision="fp32"))


def test_reference_keys_follow_the_data_not_the_name_it_is_read_under():
    """Sources drawn with names: whatever name each is read under, its key is its content's (a name swap reads the
    same entries), and different contents never share one."""
    draw = random.Random(38)
    model = {"weights": "m"}
    for _ in range(DRAWS):
        manifests = {draw_name(draw): draw_manifest(draw) for _ in range(draw.randint(2, 4))}
        by_content = {name: keys.digest(reference_logps.split_inputs(m, "train", model, RUN, 0))
                      for name, m in manifests.items()}
        renamed = dict(zip(draw.sample(list(manifests), len(manifests)), manifests.values()))
        for name, manifest in renamed.items():
            key = keys.digest(reference_logps.split_inputs(manifest, "train", model, RUN, 0))
            assert key == next(k for n, k in by_content.items() if manifests[n] is manifest)
        distinct = {json.dumps(m["splits"]["train"], sort_keys=True) for m in manifests.values()}
        assert len(set(by_content.values())) == len(distinct)


def test_every_input_of_a_reference_key_moves_it():
    draw = random.Random(39)
    for _ in range(DRAWS):
        manifest = draw_manifest(draw)
        base = keys.digest(reference_logps.split_inputs(manifest, "train", {"w": 1}, RUN, 0))
        changed = json.loads(json.dumps(manifest))
        shard = draw.choice(changed["splits"]["train"]["shards"])
        what = draw.choice(["sha256", "tokens", "tokenizer", "model", "seq_len", "pad", "precision"])
        model, run, pad = {"w": 1}, RUN, 0
        if what == "sha256":
            shard["files"][draw.choice(["tokens", "docs", "labels"])]["sha256"] = "0" * 64
        elif what == "tokens":
            shard["tokens"] += 1
        elif what == "tokenizer":
            changed["tokenizer"]["fingerprint"] = "u" * 16
        elif what == "model":
            model = {"w": 2}
        elif what == "seq_len":
            run = SimpleNamespace(data=SimpleNamespace(seq_len=128), train=RUN.train)
        elif what == "pad":
            pad = 1
        else:
            run = SimpleNamespace(data=RUN.data, train=SimpleNamespace(precision="bf16"))
        assert keys.digest(reference_logps.split_inputs(changed, "train", model, run, pad)) != base, what


# --- a model's identity ---------------------------------------------------------------------------------------------

def write_tree(root: Path, draw: random.Random) -> dict[str, bytes]:
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": draw_bytes(draw, 64, 512),
             "modeling_custom.py": b"# code a load may run\n", **{f"sub/{draw_name(draw)}.bin": draw_bytes(draw)
                                                                     for _ in range(draw.randint(0, 2))}}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def local_model(path: Path) -> ModelConfig:
    return ModelConfig(name_or_path=str(path))


def test_a_local_models_identity_moves_with_any_byte_of_any_file_it_can_load(tmp_path):
    """Weights, configs and code files alike (a code file was not in the old key); hidden entries are not read by a
    load and do not count."""
    draw = random.Random(40)
    for case in range(DRAWS // 4):
        root = tmp_path / f"model{case}"
        files = write_tree(root, draw)
        before = weights.model_identity(local_model(root), 0, tmp_path / "cache")
        (root / ".cache").mkdir()
        (root / ".cache" / "download.lock").write_bytes(b"x")
        assert weights.model_identity(local_model(root), 0, tmp_path / "cache") == before
        name = draw.choice(sorted(files))
        data = bytearray(files[name])
        data[draw.randrange(len(data))] ^= 1 << draw.randrange(8)
        (root / name).write_bytes(bytes(data))
        assert weights.model_identity(local_model(root), 0, tmp_path / "cache") != before, name


def test_settings_that_change_a_forward_move_the_identity_and_training_only_ones_do_not(tmp_path):
    base = weights.model_identity(ModelConfig(), 3, tmp_path)
    assert weights.model_identity(ModelConfig(gradient_checkpointing=True), 3, tmp_path) == base
    assert weights.model_identity(ModelConfig(attn_implementation="eager"), 3, tmp_path) != base
    assert weights.model_identity(ModelConfig(), 4, tmp_path) != base  # from scratch: the seed draws the weights


def test_weights_are_hashed_once_and_recorded(tmp_path, monkeypatch):
    """A second start (or another rank after rank 0) finds the hashes recorded by stat and reads no file."""
    draw = random.Random(41)
    root = tmp_path / "model"
    write_tree(root, draw)
    old = 2_000_000_000  # ctime must be settled for a hash to be recorded: back-date the files' timestamps
    for file in root.rglob("*"):
        os.utime(file, (old, old))
    monkeypatch.setattr(contents, "SETTLED_NS", 0)
    first = weights.model_identity(local_model(root), 0, tmp_path / "cache")
    monkeypatch.setattr(contents, "sha256_file", lambda path: pytest.fail(f"{path} was hashed again"))
    assert weights.model_identity(local_model(root), 0, tmp_path / "cache") == first


def test_a_hub_models_identity_is_its_commit_and_blobs(tmp_path, monkeypatch):
    """A ref moved to other weights is another identity; the same ref is the same; a missing ref is a named
    error, not a key without the weights."""
    draw = random.Random(42)
    snapshots = {}
    for seed in range(3):
        directory = tmp_path / f"weights{seed}"
        directory.mkdir()
        write_tree(directory, draw)
        snapshots[commit_id(seed)] = directory
    ref = make_hub_cache(tmp_path / "hub", "org/model", snapshots)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(weights, "hub_cache_root", lambda: tmp_path / "hub")
    seen = set()
    for commit in snapshots:
        ref.write_text(commit)
        identity = weights.model_identity(ModelConfig(name_or_path="org/model"), 0, tmp_path / "cache")
        assert identity["weights"]["commit"] == commit
        assert identity == weights.model_identity(ModelConfig(name_or_path="org/model"), 0, tmp_path / "cache")
        seen.add(json.dumps(identity, sort_keys=True))
    assert len(seen) == len(snapshots)
    with pytest.raises(CacheError, match="no .*refs/main in the local hub cache"):
        weights.model_identity(ModelConfig(name_or_path="org/absent"), 0, tmp_path / "cache")


# --- entries --------------------------------------------------------------------------------------------------------

def filled(tmp_path: Path, values: np.ndarray, inputs) -> Path:
    entry = tmp_path / "kind" / keys.digest(inputs)
    entries.fill(entry, lambda d: reference_logps.write_entry(d, values, keys.canonical(inputs)))
    return entry


def corrupt(entry: Path, draw: random.Random, pairs: int) -> str:
    """One drawn way an entry can be what the cache did not write; returns what the refusal must say."""
    values = entry / reference_logps.VALUES
    how = draw.choice(["nan", "inf", "shape", "dtype", "link", "foreign", "world", "inputs", "pickle"])
    if how in ("nan", "inf", "shape", "dtype", "pickle"):
        data = np.zeros((pairs, 2))
        if how in ("nan", "inf"):
            data[draw.randrange(pairs), draw.randrange(2)] = np.nan if how == "nan" else -np.inf
        elif how == "shape":
            data = np.zeros((pairs + draw.randint(1, 3), 2))
        elif how == "dtype":
            data = data.astype(draw.choice([np.float32, np.int64]))
        values.unlink()
        if how == "pickle":
            np.save(values, np.array([{"a": 1}], dtype=object), allow_pickle=True)
            return "not a readable array"
        np.save(values, data)
        return {"nan": "is not finite", "inf": "is not finite", "shape": "of shape", "dtype": "of shape"}[how]
    if how == "link":
        target = entry.parent / "elsewhere.npy"
        values.rename(target)
        values.symlink_to(target)
        return "is a symbolic link"
    if how == "foreign":
        if os.getuid() != 0:
            pytest.skip("changing a file's owner needs root")
        os.chown(values, 12345, -1)
        return "belongs to user id 12345"
    if how == "world":
        os.chmod(draw.choice([values, entry]), 0o777)
        return "can be written by every user"
    (entry / entries.INPUTS).unlink()
    entries.record_inputs(entry, keys.canonical([("kind", "other")]))
    return "records other inputs"


def test_an_entry_the_cache_did_not_write_is_refused_naming_the_file(tmp_path):
    draw = random.Random(43)
    for case in range(DRAWS):
        pairs = draw.randint(1, 20)
        inputs = [("kind", "test"), ("case", case)]
        entry = filled(tmp_path / str(case), np.arange(pairs * 2, dtype=np.float64).reshape(pairs, 2), inputs)
        assert reference_logps.read_entry(entry, keys.canonical(inputs), pairs, False).shape == (pairs, 2)
        says = corrupt(entry, draw, pairs)
        with pytest.raises(CacheError) as refused:
            reference_logps.read_entry(entry, keys.canonical(inputs), pairs, False)
        assert says in str(refused.value) and str(entry) in str(refused.value) and f"delete {entry}" in \
            str(refused.value)


def test_a_linked_entry_and_a_world_writable_cache_without_sticky_bit_are_refused(tmp_path):
    inputs = [("kind", "test")]
    entry = filled(tmp_path, np.zeros((2, 2)), inputs)
    moved = tmp_path / "moved"
    entry.rename(moved)
    entry.symlink_to(moved)
    with pytest.raises(CacheError, match="is a symbolic link .* never links"):
        reference_logps.read_entry(entry, keys.canonical(inputs), 2, False)
    entry.unlink()
    moved.rename(entry)
    os.chmod(entry.parent, 0o777)
    with pytest.raises(CacheError, match="no sticky bit"):
        reference_logps.read_entry(entry, keys.canonical(inputs), 2, False)
    with pytest.raises(CacheError, match="no sticky bit"):
        entries.fill(entry.parent / "another", lambda d: None)
    os.chmod(entry.parent, 0o777 | 0o1000)
    assert reference_logps.read_entry(entry, keys.canonical(inputs), 2, False).shape == (2, 2)


def test_a_planted_name_is_never_written_through(tmp_path):
    """write_file creates its file exclusively and never through a link: a planted link (to a file someone wants
    overwritten) or file at the name is an error, and the target keeps its bytes."""
    draw = random.Random(44)
    for case in range(10):
        victim = tmp_path / f"victim{case}"
        victim.write_bytes(b"keep")
        planted = tmp_path / f"values{case}.npy"
        if draw.random() < 0.5:
            planted.symlink_to(victim)
        else:
            planted.write_bytes(b"planted")
        with pytest.raises(OSError):
            entries.write_array(planted, np.zeros(3))
        assert victim.read_bytes() == b"keep"


def test_values_that_are_not_finite_are_never_cached(tmp_path):
    draw = random.Random(45)
    for case in range(10):
        values = np.zeros((draw.randint(1, 9), 2))
        values.reshape(-1)[draw.randrange(values.size)] = draw.choice([np.nan, np.inf, -np.inf])
        entry = tmp_path / f"entry{case}"
        with pytest.raises(CacheError, match="not finite; nothing was cached"):
            entries.fill(entry, lambda d: reference_logps.write_entry(d, values, "[]"))
        assert not entry.exists() and not list(tmp_path.glob(f".entry{case}.*"))


def test_keys_are_over_inputs_in_order_and_refuse_a_name_given_twice():
    draw = random.Random(46)
    for _ in range(DRAWS):
        inputs = [(draw_name(draw) + str(i), draw_bytes(draw, 1, 8).hex()) for i in range(draw.randint(2, 5))]
        shuffled = draw.sample(inputs, len(inputs))
        assert (keys.digest(shuffled) == keys.digest(inputs)) == (shuffled == inputs)
        as_dict = {"b": 1, "a": [1, 2]}
        assert keys.digest([("x", as_dict)]) == keys.digest([("x", dict(reversed(list(as_dict.items()))))])
    with pytest.raises(ValueError, match="named twice"):
        keys.digest([("a", 1), ("a", 2)])


def test_a_shard_written_over_a_planted_temporary_name_leaves_the_target_alone(tmp_path):
    """Prepared data's temporary names are predictable (`.<name>.tmp`, so an interrupted run can be continued): a
    link planted there is removed, never followed, and the file is created exclusively."""
    from trainer.data import shards
    draw = random.Random(47)
    for case in range(10):
        victim = tmp_path / f"victim{case}"
        victim.write_bytes(b"keep")
        target = tmp_path / f"{draw_name(draw)}{case}.json"
        (tmp_path / f".{target.name}.tmp").symlink_to(victim)
        data = draw_bytes(draw)
        shards.write_atomic(target, data)
        assert target.read_bytes() == data and victim.read_bytes() == b"keep"
