"""AutoTP training and preset rehearsals on 2 CPU ranks (separate launches: DeepSpeed keeps one TP mesh
per process, and the rehearsals use their own run directories)."""
from __future__ import annotations

import pytest

from conftest import STAGES, TINY
from distributed import losses, read_metrics, run_many

pytestmark = pytest.mark.multirank

SHIPPED = ["tiny_cpu", "7b_8xa100", "70b_8xa100", "70b_32xa100", "7b_2xv100", "1b_pretrain_8xh100", "7b_lora_1x4090",
           "7b_dpo_8xa100", "7b_dpo_lora_1x4090",
           "8b_128k_8xh100"]


@pytest.fixture(scope="module")
def autotp_runs(tmp_path_factory, pretrained_dir, engine_runs):
    """AutoTP 2 with ZeRO-1 and ZeRO-3, from scratch and from the same pretrained weights. TP 2 on 2 ranks
    leaves one data-parallel rank, so micro-batch 4 sees the same 8 sequences per step as 2 x 2 ranks."""
    root = tmp_path_factory.mktemp("autotp")
    runs = []
    for stage in ("z1", "z3"):
        for source, extra in (("scratch", []), ("pretrained", [f"model.name_or_path={pretrained_dir}"])):
            name = f"{source}_tp2_{stage}"
            runs.append({"name": name, "preset": "tiny_cpu", "overrides": TINY + STAGES[stage] + extra + [
                "deepspeed.tensor_parallel={autotp_size: 2}", "train.micro_batch_size=4", "train.export_hf=true",
                f"train.output_dir={root / name}"]})
    run_many(runs, root)
    return root, engine_runs[0]


@pytest.mark.parametrize("stage", ["z1", "z3"])
@pytest.mark.parametrize("source", ["scratch", "pretrained"])
def test_autotp_matches_data_parallel(autotp_runs, source, stage):
    root, dirs = autotp_runs
    assert losses(root / f"{source}_tp2_{stage}") == pytest.approx(losses(dirs[f"{source}_z0"]), abs=2e-5)


@pytest.mark.parametrize("source", ["scratch", "pretrained"])
def test_autotp_zero1_checkpoint_consolidates_to_the_export(autotp_runs, source):
    """`generate/evaluate --model <checkpoint>` of an AutoTP run: the slices of both TP ranks put back together
    equal, tensor for tensor, what the engine itself gathered into the HF export."""
    import torch
    from safetensors.torch import load_file

    from trainer.infer.source import load_model, resolve_source
    run = autotp_runs[0] / f"{source}_tp2_z1"
    model = load_model(resolve_source(str(run / "checkpoints" / "step_00000006")), torch.float32)
    exported = load_file(run / "hf" / "model.safetensors")
    state = model.state_dict()
    assert set(exported) <= set(state)
    for name, tensor in exported.items():
        assert torch.equal(state[name], tensor), name


def test_autotp_zero3_checkpoint_is_refused_with_the_way_out(autotp_runs):
    from trainer.errors import UserError
    from trainer.infer.source import load_model, resolve_source
    import torch
    with pytest.raises(UserError, match="AutoTP x ZeRO-3.*hf/"):
        load_model(resolve_source(str(autotp_runs[0] / "scratch_tp2_z3" / "checkpoints" / "step_00000006")),
                   torch.float32)


@pytest.fixture(scope="module")
def rehearsals(tmp_path_factory):
    """Every shipped preset rehearsed: 3 steps and a save, then --resume auto to step 6 and the export."""
    root = tmp_path_factory.mktemp("rehearse")

    def rehearsal(preset, extra):
        return {"name": preset, "preset": preset, "rehearse": True,
                "overrides": [f"train.output_dir={root / preset / 'run'}", extra]}

    # DeepSpeed creates the hpZ process group once per process, so the ZeRO++ preset's second run
    # (the resume) needs a fresh launch; the others share one.
    plain = [p for p in SHIPPED if p != "70b_32xa100"]
    launches = [[rehearsal(p, extra) for p in plain for extra in ("train.stop_after=3", "train.resume=auto")],
                [rehearsal("70b_32xa100", "train.stop_after=3")], [rehearsal("70b_32xa100", "train.resume=auto")]]
    output = ""
    for index, runs in enumerate(launches):
        work = root / f"launch{index}"
        work.mkdir()
        output += run_many(runs, work, timeout=2400)[0]
    return root, output


@pytest.mark.parametrize("preset", SHIPPED)
def test_every_preset_rehearses_saves_and_resumes(rehearsals, preset):
    root, output = rehearsals
    run = root / preset / "run"  # train.output_dir given with --set: the rehearsal keeps it (--set outranks it)
    rows, evals = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # 3 steps, stop, resume, 3 more
    assert evals and all(e["eval_loss"] > 0 for e in evals)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    assert any((run / "hf").glob("*.safetensors"))
    assert f"rehearsal of {preset}" in output and f"resume: continuing from {run / 'checkpoints'}" in output
