"""Checkpoint files hashed as they are written and loaded from a mapping (trainer/train/checkpoint_io.py): the
manifest still says what is on disk, a resume still restores every bit, and no tensor keeps a checkpoint file.
The round trip runs real engines on 2 ranks (tests/workers/checkpoint_roundtrip.py, inside conftest's
engine_runs launch), the rest in this process."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from conftest import ROUNDTRIP_STAGES
from trainer.train import checkpoint_io, integrity


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_the_digest_recorded_while_writing_is_the_files(tmp_path, zipfile):
    state = {"weights": torch.randn(300_000), "nested": [torch.arange(7), {"half": torch.ones(5).bfloat16()}],
             "step": 3, "name": "x" * 10_000}
    writer = checkpoint_io.StreamingCheckpointEngine(zipfile)
    path = tmp_path / "state.pt"
    writer.save(state, str(path))
    assert writer.take_written() == {str(path): {"bytes": path.stat().st_size, "sha256": sha256(path)}}
    assert writer.take_written() == {}  # taken once
    loaded = writer.load(str(path), map_location="cpu")
    assert torch.equal(loaded["weights"], state["weights"]) and loaded["step"] == 3
    assert torch.equal(loaded["nested"][1]["half"], state["nested"][1]["half"])


def test_a_file_larger_than_the_writeback_window_is_hashed_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_io, "WRITEBACK_BYTES", 1 << 20)  # hand pages to the disk every MiB
    monkeypatch.setattr(checkpoint_io, "SLICE_BYTES", 100_003)  # slices that do not divide the tensors
    writer = checkpoint_io.StreamingCheckpointEngine()
    path = tmp_path / "big.pt"
    writer.save({"a": torch.randn(1_500_000), "b": torch.randn(10)}, str(path))
    assert writer.take_written()[str(path)]["sha256"] == sha256(path)


def test_the_loader_refuses_code_even_in_a_file_swapped_after_vetting(tmp_path):
    """DeepSpeed's own engine loads with weights_only=False; the streaming one never does."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "x": Payload()}, path)
    with pytest.raises(Exception, match="weights_only|Unsupported global"):
        checkpoint_io.StreamingCheckpointEngine().load(str(path))
    assert not marker.exists()


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_the_read_ahead_hash_is_the_files(tmp_path, monkeypatch, size):
    """Verification reads the next chunk while hashing the last: chunk edges must not drop or repeat a byte."""
    monkeypatch.setattr(integrity, "_HASH_CHUNK", 4096)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(size))
    assert integrity.sha256_file(path) == sha256(path)


def test_the_manifest_takes_the_writers_digests_and_hashes_the_rest(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"a" * 1000)
    (tmp_path / "b.json").write_bytes(b"{}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.bin").write_bytes(b"c" * 10)
    recorded = {"a.pt": {"bytes": 1000, "sha256": "0" * 64}}  # a digest only the writer could know
    manifest = integrity.build_manifest(tmp_path, "step_1", True, torch.device("cpu"), recorded)
    assert manifest["files"] == {"a.pt": recorded["a.pt"],
                                 "b.json": {"bytes": 2, "sha256": sha256(tmp_path / "b.json")},
                                 "sub/c.bin": {"bytes": 10, "sha256": sha256(tmp_path / "sub" / "c.bin")}}


def test_a_file_changed_after_its_writer_recorded_it_is_hashed_from_disk(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"a" * 1001)
    stale = {"a.pt": {"bytes": 1000, "sha256": "0" * 64}, "gone.pt": {"bytes": 5, "sha256": "1" * 64}}
    manifest = integrity.build_manifest(tmp_path, "step_1", True, torch.device("cpu"), stale)
    assert manifest["files"] == {"a.pt": {"bytes": 1001, "sha256": sha256(tmp_path / "a.pt")}}


def test_sizes_only_manifests_do_not_take_a_recorded_digest(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"a" * 10)
    manifest = integrity.build_manifest(tmp_path, "step_1", False, torch.device("cpu"),
                                        {"a.pt": {"bytes": 10, "sha256": "0" * 64}})
    assert manifest["files"] == {"a.pt": {"bytes": 10}}


@pytest.mark.parametrize("entry", [5, {"bytes": "5"}, {"bytes": -1}, {"bytes": 5, "sha256": "xyz"},
                                   {"bytes": 5, "sha256": "0" * 64, "extra": 1}, {"bytes": True}])
def test_a_manifest_entry_of_another_shape_is_a_named_error(tmp_path, entry):
    (tmp_path / "a.pt").write_bytes(b"a" * 5)
    (tmp_path / "COMPLETE").write_text(json.dumps({"manifest_version": 1, "tag": "t", "files": {"a.pt": entry}}))
    with pytest.raises(integrity.CheckpointError, match=r"COMPLETE lists 'a.pt' with .*resume another checkpoint"):
        integrity.verify_checkpoint(tmp_path, torch.device("cpu"))


def test_the_ranks_hash_shares_of_equal_bytes():
    """A 2-rank ZeRO-3 checkpoint: split round-robin by name, both optimizer partitions fall to rank 0."""
    sizes = {"rng_rank0.json": 1, "rng_rank1.json": 1, "trainer_state.json": 2,
             "zero_pp_rank_0_mp_rank_00_model_states.pt": 3, "zero_pp_rank_0_mp_rank_00_optim_states.pt": 550,
             "zero_pp_rank_1_mp_rank_00_model_states.pt": 3, "zero_pp_rank_1_mp_rank_00_optim_states.pt": 550,
             "zero_to_fp32.py": 2}
    shares = [integrity._my_share_of_bytes(sizes, rank, 2) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(sizes)
    assert [sum(sizes[name] for name in share) for share in shares] == [556, 556]


# --- real engines, 2 ranks (conftest's engine_runs launch runs tests/workers/checkpoint_roundtrip.py) -----------

@pytest.fixture(scope="module")
def roundtrips(engine_runs):
    return json.loads((engine_runs[0]["checkpoint_roundtrip"] / "report.json").read_text())


@pytest.mark.multirank
@pytest.mark.parametrize("name", ROUNDTRIP_STAGES)
def test_a_saved_checkpoint_resumes_every_bit_and_its_manifest_is_the_disks(roundtrips, name):
    found = roundtrips[name]
    assert found["manifest_mismatches"] == []
    assert found["weights_equal"] and found["optimizer_equal"]
    for saver_losses, loader_losses in found["losses"]:  # each rank's
        assert saver_losses == loader_losses  # bitwise: the steps after the resume are the uninterrupted run's


@pytest.mark.multirank
@pytest.mark.parametrize("name", ROUNDTRIP_STAGES)
def test_no_tensor_keeps_a_checkpoint_file_mapped_after_the_load(roundtrips, name):
    """Retention deletes old checkpoints: a mapping left in the optimizer would hold the file's disk space."""
    assert roundtrips[name]["mapped_after_load"] == []
