"""A planted pickle never runs (issue: reliability round 2).

DeepSpeed 0.19.8 loads checkpoint files with torch.load(weights_only=False). Which files a rank loads
depends on the layout: ZeRO-3 partitions, `elastic_checkpoint` (every rank reads every rank's optimizer
file), AutoTP (files named by data/model-parallel rank), universal checkpoints (a folder per parameter).
Each case below plants an object whose unpickling runs a shell command into one file of a real
checkpoint -- re-writing the manifest in COMPLETE too, as an attacker would -- and resumes on 2 ranks: the
run is refused, naming the file, and the command never runs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import STAGES, TINY
from distributed import REPO, run_many
from trainer.train import integrity

pytestmark = pytest.mark.multirank

LAYOUTS = {
    "z1": STAGES["z1"],
    "z2": STAGES["z2"],
    "z3": STAGES["z3"],
    "z1_elastic": STAGES["z1"] + ["deepspeed.zero_optimization.elastic_checkpoint=true"],
    "z2_elastic": STAGES["z2"] + ["deepspeed.zero_optimization.elastic_checkpoint=true"],
    "tp2_z1": STAGES["z1"] + ["deepspeed.tensor_parallel={autotp_size: 2}", "train.micro_batch_size=4"],
}
SHORT = ["train.max_steps=2", "train.save_every=2", "train.eval_every=0", "logging.progress_bar=false"]


class RunsCode:
    """Unpickling this runs `touch <marker>`: the payload of a crafted checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(file, marker) -> None:
    state = torch.load(file, map_location="cpu", weights_only=False)  # our own file: trusted
    if isinstance(state, dict):
        state["planted"] = RunsCode(marker)
    else:  # universal step.pt holds a bare number
        state = [state, RunsCode(marker)]
    torch.save(state, file)


def forge_manifest(ckpt) -> None:
    """What an attacker who can write the checkpoint does next: make COMPLETE agree with the new bytes."""
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": integrity.sha256_file(ckpt / name)}
    (ckpt / "COMPLETE").write_text(json.dumps(manifest))


def pickle_files(ckpt) -> list[str]:
    return sorted(p.name for p in ckpt.glob("*.pt"))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """One real 2-step checkpoint per layout."""
    root = tmp_path_factory.mktemp("layouts")
    runs = [{"name": name, "preset": "tiny_cpu", "overrides": TINY + SHORT + extra + [f"train.output_dir={root / name}"]}
            for name, extra in LAYOUTS.items()]
    run_many(runs, root)
    return root


@pytest.fixture(scope="module")
def planted(layouts, tmp_path_factory):
    """Resume every (layout, planted file) case, plus each intact layout, in one 2-rank launch."""
    root = tmp_path_factory.mktemp("planted")
    markers = root / "markers"
    markers.mkdir()
    runs, cases = [], {}
    for layout, extra in LAYOUTS.items():
        source = layouts / layout / "checkpoints" / "step_00000002"
        for file in pickle_files(source):
            name = f"{layout}:{file}"
            run_dir = root / name.replace(":", "__")
            ckpt = run_dir / "checkpoints" / "step_00000002"
            shutil.copytree(source, ckpt)
            plant(ckpt / file, markers / name.replace(":", "__"))
            forge_manifest(ckpt)
            cases[name] = ckpt
            runs.append({"name": name, "preset": "tiny_cpu", "expect_error": True, "overrides": TINY + SHORT + extra + [
                "train.max_steps=3", f"train.output_dir={run_dir}", f"train.resume={ckpt}"]})
        runs.append({"name": f"{layout}:intact", "preset": "tiny_cpu", "overrides": TINY + SHORT + extra + [
            "train.max_steps=3", f"train.output_dir={layouts / layout}", "train.resume=auto"]})
    _, report = run_many(runs, root)
    return {row["name"]: row["error"] for row in report}, cases, markers


def test_every_layout_has_the_file_kinds_deepspeed_loads(layouts):
    kinds = {layout: pickle_files(layouts / layout / "checkpoints" / "step_00000002") for layout in LAYOUTS}
    assert kinds["z2"] == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                           "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt" in kinds["z3"]
    assert "mp_rank_01_model_states.pt" in kinds["tp2_z1"]  # AutoTP: named by model-parallel rank


def test_the_payload_is_live(layouts, tmp_path):
    """The control: loaded the way DeepSpeed loads it, a planted file does run its command."""
    file = tmp_path / "mp_rank_00_model_states.pt"
    shutil.copy(layouts / "z2" / "checkpoints" / "step_00000002" / file.name, file)
    plant(file, tmp_path / "ran")
    torch.load(file, weights_only=False)
    assert (tmp_path / "ran").exists()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_planted_pickle_in_any_file_is_refused_and_never_runs(planted, layout):
    errors, cases, markers = planted
    mine = [name for name in cases if name.startswith(f"{layout}:")]
    assert mine
    for name in mine:
        planted_file = name.split(":", 1)[1]
        error = errors[name]
        assert error and f"{planted_file} holds objects a weights-only load does not allow" in error, (name, error)
        assert "Unsupported global" in error and "posix.system" in error, error
    assert not any(markers.iterdir()), f"planted code ran: {sorted(p.name for p in markers.iterdir())}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_intact_checkpoint_of_each_layout_resumes(planted, layouts, layout):
    errors, _, _ = planted
    assert errors[f"{layout}:intact"] is None
    rows = [json.loads(line) for line in (layouts / layout / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 3


def test_a_plant_without_a_forged_manifest_is_refused_for_its_checksum(layouts, tmp_path):
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(layouts / "z2" / "checkpoints" / "step_00000002", ckpt)
    plant(ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tmp_path / "ran")
    with pytest.raises(integrity.CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt (is corrupt or )?was changed after it was saved"):
        integrity.verify_checkpoint(ckpt, torch.device("cpu"))
    assert not (tmp_path / "ran").exists()


def test_every_file_of_a_universal_checkpoint_is_vetted(layouts, tmp_path):
    """DeepSpeed's own converter makes the universal layout (zero/<param>/fp32.pt, exp_avg.pt, ...)."""
    universal = tmp_path / "step_00000002_universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(layouts / "z2" / "checkpoints" / "step_00000002"), "--output_folder", str(universal),
                    "--num_extract_workers", "1", "--num_merge_workers", "1"],
                   check=True, cwd=REPO, capture_output=True, timeout=600)
    (universal / "COMPLETE").write_text("step_00000002_universal\n")  # no manifest: only the vetting stands
    assert integrity.verify_checkpoint(universal, torch.device("cpu")) == []  # DeepSpeed's own files pass
    kinds = sorted({p.name for p in (universal / "zero").rglob("*.pt")})
    assert {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"} <= set(kinds), kinds
    for kind in kinds:
        victim = sorted((universal / "zero").rglob(kind))[-1]
        original = victim.read_bytes()
        plant(victim, tmp_path / "ran")
        with pytest.raises(integrity.CheckpointError, match=f"{victim.relative_to(universal)} holds objects"):
            integrity.verify_checkpoint(universal, torch.device("cpu"))
        victim.write_bytes(original)
    assert not (tmp_path / "ran").exists()


def test_a_planted_file_under_any_name_is_vetted(tmp_path):
    """DeepSpeed globs for files; a pickle is vetted by its name or its first bytes, whatever it is called."""
    (tmp_path / "COMPLETE").write_text("step_00000001\n")
    torch.save({"x": RunsCode(tmp_path / "ran")}, tmp_path / "notes.txt")
    with pytest.raises(integrity.CheckpointError, match="notes.txt holds objects"):
        integrity.verify_checkpoint(tmp_path, torch.device("cpu"))
    assert not (tmp_path / "ran").exists()


def test_a_link_inside_a_checkpoint_is_refused(layouts, tmp_path):
    """A symlinked folder would lead DeepSpeed's universal loader to files the vetting never saw."""
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(layouts / "z2" / "checkpoints" / "step_00000002", ckpt)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save({"x": RunsCode(tmp_path / "ran")}, elsewhere / "fp32.pt")
    (ckpt / "zero").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(integrity.CheckpointError, match="zero is a symbolic link"):
        integrity.verify_checkpoint(ckpt, torch.device("cpu"))
    assert not (tmp_path / "ran").exists()
