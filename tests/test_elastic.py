"""Resuming on another topology (issue 11): a ZeRO checkpoint of 2 ranks continued on 1, of 1 on 2, and of ZeRO-2
at ZeRO-3, through DeepSpeed's universal checkpoints; each continues the uninterrupted run's losses, and the
checkpoints written after the switch consolidate with DeepSpeed's zero_to_fp32 to the uninterrupted run's weights.
Unit tests of the decisions (which layouts convert, which global batches can be kept) run without ranks."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import STAGES, TINY
from distributed import last_wins, launch, read_metrics, run_many
from trainer.presets import load_preset
from trainer.resolve import resolve
from trainer.train import checkpoint, elastic
from trainer.train.elastic import ElasticResumeError, Layout

SAVE_AT = 4
BASE = TINY + ["train.max_steps=8", f"train.save_every={SAVE_AT}", "train.keep_last=5", "train.eval_every=0",
               "logging.progress_bar=false", "deepspeed.optimizer.params.torch_adam=true"]
ONE_RANK = ["hardware.gpus_per_node=1"]
# Measured on this machine (fp32, torch Adam): after the switch the losses differ from the uninterrupted run's
# by at most 7.2e-8 relative and the step-8 weights by 1.2e-7 absolute (float32 rounding: another reduction order
# over ranks and accumulation steps). A resume that lost the optimizer state misses by ~1e-3.
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-6


def tag(step: int) -> str:
    return checkpoint.tag_for(step)


def copy_until(src, dst, step: int):
    """A copy of run `src` whose newest checkpoint is `step` (later ones and the metrics removed)."""
    shutil.copytree(src, dst)
    for path in checkpoint.complete_checkpoints(dst / "checkpoints"):
        if path.name > tag(step):
            shutil.rmtree(path)
    (dst / "metrics.jsonl").unlink()
    return dst


def run(name, root, extra, expect_error=False):
    return {"name": name, "preset": "tiny_cpu", "expect_error": expect_error,
            "overrides": last_wins(BASE + extra + [f"train.output_dir={root / name}"])}


def one_rank_launch(runs, root):
    """run_many on one rank (a second deepspeed launch: the world size is fixed per launch)."""
    spec, report = root / "spec1.json", root / "report1.json"
    spec.write_text(json.dumps({"runs": runs, "report": str(report)}))
    output = launch(["tests/workers/run_many.py", str(spec)], ranks=1)
    return output, json.loads(report.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three launches: 2 ranks straight; 1 rank (2 -> 1, a 1-rank start, a refused batch); 2 ranks (1 -> 2, ZeRO-3)."""
    root = tmp_path_factory.mktemp("elastic")
    out = {}
    out["straight"] = run_many([run("straight", root, STAGES["z2"])], root)[0]
    copy_until(root / "straight", root / "to1", SAVE_AT)
    debris = root / "to1" / "checkpoints" / tag(SAVE_AT) / "universal.tmp"
    debris.mkdir()
    (debris / "half_written.pt").write_bytes(b"\x80\x02 not a whole pickle")  # a conversion killed midway
    copy_until(root / "straight", root / "refused", SAVE_AT)
    out["one_rank"], report = one_rank_launch([
        run("to1", root, STAGES["z2"] + ONE_RANK + ["train.resume=auto"]),
        run("one", root, STAGES["z2"] + ONE_RANK + ["train.grad_accum=4", f"train.stop_after={SAVE_AT}"]),
        run("refused", root, STAGES["z2"] + ONE_RANK + ["train.resume=auto", "train.grad_accum=1"], expect_error=True),
    ], root)
    out["errors"] = {row["name"]: row["error"] for row in report}
    shutil.copytree(root / "one", root / "to2")
    (root / "to2" / "metrics.jsonl").unlink()
    copy_until(root / "straight", root / "to3", SAVE_AT)
    shutil.copytree(root / "to1" / "checkpoints" / tag(SAVE_AT) / "universal",  # made by the 2 -> 1 resume
                    root / "to3" / "checkpoints" / tag(SAVE_AT) / "universal")
    out["two_ranks"] = run_many([run("to2", root, STAGES["z2"] + ["train.resume=auto"]),
                                 run("to3", root, STAGES["z3"] + ["train.resume=auto"])], root)[0]
    return root, out


def losses(run_dir) -> dict[int, float]:
    rows, _ = read_metrics(run_dir)
    return {row["step"]: row["loss"] for row in rows}


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["to1", "to2", "to3"])
def test_a_resume_on_another_topology_continues_the_uninterrupted_losses(runs, name):
    root, _ = runs
    straight, resumed = losses(root / "straight"), losses(root / name)
    assert sorted(resumed) == list(range(SAVE_AT + 1, 9))
    for step, loss in resumed.items():
        assert loss == pytest.approx(straight[step], rel=LOSS_RTOL), (name, step, loss, straight[step])


@pytest.mark.multirank
def test_the_conversion_is_announced_made_once_and_reused(runs):
    root, out = runs
    assert "2 rank(s) (data-parallel 2), ZeRO-2 -> 1 rank(s) (data-parallel 1), ZeRO-2: converting step_00000004" \
        in out["one_rank"]
    assert "global batch 8 kept from the checkpoint: gradient accumulation 2 -> 4" in out["one_rank"]
    assert "1 rank(s) (data-parallel 1), ZeRO-2 -> 2 rank(s) (data-parallel 2), ZeRO-2: converting" in out["two_ranks"]
    assert "ZeRO-2 -> 2 rank(s) (data-parallel 2), ZeRO-3: reusing the universal conversion" in out["two_ranks"]
    kept = root / "to1" / "checkpoints" / tag(SAVE_AT)
    assert (kept / "universal" / "COMPLETE").is_file() and not (kept / "universal.tmp").exists()
    assert (kept / "universal" / tag(SAVE_AT) / "zero").is_dir()  # DeepSpeed's universal layout


@pytest.mark.multirank
def test_checkpoints_around_a_conversion_stay_ordinary(runs, tmp_path):
    """The conversion lives inside the checkpoint it came from: resume, retention and manifests see no new one.
    (On a copy: pruning the module's own run would take the conversion from the tests that read it after this one;
    the reverse-order run found it.)"""
    root, _ = runs
    ckpt = shutil.copytree(root / "to1" / "checkpoints", tmp_path / "checkpoints", symlinks=True)
    assert [p.name for p in checkpoint.complete_checkpoints(ckpt)] == [tag(SAVE_AT), tag(8)]
    assert checkpoint.find_resume("auto", ckpt) == ckpt / tag(8)
    checkpoint.verify(ckpt / tag(SAVE_AT), "cpu")  # the original's manifest still holds
    assert checkpoint.lineage(ckpt, tag(SAVE_AT)) == [tag(SAVE_AT)]
    removed = checkpoint.prune(ckpt, keep_last=1)
    assert removed == [ckpt / tag(SAVE_AT)] and not removed[0].exists()  # with its conversion


@pytest.mark.multirank
def test_a_grad_accum_that_breaks_the_global_batch_is_named(runs):
    _, out = runs
    error = out["errors"]["refused"]
    assert "global batch of 8 sequences" in error and "train.grad_accum=1" in error
    assert "recomputed to 4" in error and "train.global_batch_size=2" in error


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["to1", "to2", "to3"])
def test_checkpoints_after_the_switch_consolidate_with_zero_to_fp32(runs, name):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    root, _ = runs
    reference = get_fp32_state_dict_from_zero_checkpoint(str(root / "straight" / "checkpoints"), tag=tag(8))
    resumed = get_fp32_state_dict_from_zero_checkpoint(str(root / name / "checkpoints"), tag=tag(8))
    assert resumed.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.allclose(resumed[key], tensor, atol=WEIGHT_ATOL, rtol=0), (name, key)


# --- decisions, without ranks ------------------------------------------------------------------------------

def layout(world=2, dp=2, tp=1, stage=2, ep=1) -> Layout:
    return Layout(world, dp, tp, stage, expert_parallel_size=ep)


def test_layouts_that_convert_and_those_that_need_none(tmp_path):
    assert not elastic.needs_universal(layout(), layout(), tmp_path)
    assert not elastic.needs_universal(None, layout(), tmp_path)  # a state without a recorded layout
    assert not elastic.needs_universal(layout(stage=0), layout(world=1, dp=1, stage=0), tmp_path)
    assert elastic.needs_universal(layout(), layout(world=1, dp=1), tmp_path)
    assert elastic.needs_universal(layout(stage=2), layout(stage=3), tmp_path)


@pytest.mark.parametrize("saved, now, words", [
    (layout(world=2, dp=1, tp=2, stage=1), layout(world=1, dp=1, tp=1, stage=1), "AutoTP"),
    (layout(stage=2), layout(world=2, dp=1, tp=2, stage=2), "AutoTP"),
    (layout(stage=0), layout(stage=3), "ZeRO-0 checkpoint"),
    (layout(stage=3, ep=2), layout(world=1, dp=1, stage=3), "expert-parallel run.*autoep_size=2 on 2 rank"),
    (layout(stage=0, ep=2), layout(stage=0), "switching AutoEP on or off"),  # even where ZeRO-0 would load anywhere
    (layout(stage=2), layout(world=1, dp=1, stage=0), "resume at ZeRO-1, 2 or 3"),
])
def test_layouts_no_conversion_bridges_are_named(tmp_path, saved, now, words):
    with pytest.raises(ElasticResumeError, match=words) as err:
        elastic.needs_universal(saved, now, tmp_path)
    assert "--set" in str(err.value) or "resume with" in str(err.value)


def saved_config(global_batch=16, micro=8, accum=1, dp=2) -> dict:
    return {"train": {"global_batch_size": global_batch, "micro_batch_size": micro, "grad_accum": accum},
            "derived": {"world_size": dp, "data_parallel_size": dp, "autotp_size": 1, "zero_stage": 2}}


def resolved_for(world: int, *overrides: str):
    return resolve(load_preset("tiny_cpu", list(overrides)), world)


def test_the_global_batch_is_kept_by_recomputing_the_accumulation(tmp_path):
    items, notice = elastic.batch_overrides(saved_config(), resolved_for(1), set(), tmp_path)
    assert "train.grad_accum=2" in items and "train.global_batch_size=16" in items
    again = resolve(load_preset("tiny_cpu", items), 1)
    assert (again.batch.grad_accum, again.batch.global_batch_size) == (2, 16)
    assert "gradient accumulation 1 -> 2" in notice
    assert elastic.batch_overrides(saved_config(), resolved_for(2), set(), tmp_path) == ([], None)


def test_a_global_batch_no_accumulation_keeps_is_named(tmp_path):
    with pytest.raises(ElasticResumeError, match=r"16 is not a multiple of 8 x 3 = 24") as err:
        elastic.batch_overrides(saved_config(), resolved_for(3), set(), tmp_path)
    assert "train.global_batch_size=24" in str(err.value)


def test_the_checkpoints_own_accumulation_given_again_is_recomputed(tmp_path):
    items, _ = elastic.batch_overrides(saved_config(), resolved_for(1, "train.grad_accum=1"), {"train.grad_accum"},
                                       tmp_path)
    assert "train.grad_accum=2" in items
    with pytest.raises(ElasticResumeError, match="train.grad_accum=3 this invocation sets"):
        elastic.batch_overrides(saved_config(), resolved_for(1, "train.grad_accum=3", "train.global_batch_size=auto"),
                                {"train.grad_accum"}, tmp_path)


def test_an_explicit_global_batch_changes_it_on_purpose(tmp_path):
    items, notice = elastic.batch_overrides(saved_config(), resolved_for(1, "train.global_batch_size=8"),
                                            {"train.global_batch_size"}, tmp_path)
    assert items == [] and "from the checkpoint's 16 to 8" in notice


def test_the_engine_config_says_what_deepspeed_reads():
    """The keys written for universal loading and the checkpoint writer are the ones DeepSpeed 0.19.8 parses."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from trainer.train.run import engine_config
    cfg = resolved_for(1, "hardware.gpus_per_node=1", "hardware.gpu=a100-80g",
                       "train.checkpoint_writer=decoupled").config
    parsed = DeepSpeedConfig(engine_config(cfg, universal=True))
    assert parsed.load_universal_checkpoint is True
    assert parsed.checkpoint_config["writer"]["type"] == "FAST" and parsed.checkpoint_config["writer"]["decoupled"]
    plain = DeepSpeedConfig(engine_config(resolved_for(1, "hardware.gpus_per_node=1").config, universal=False))
    assert plain.load_universal_checkpoint is False and plain.checkpoint_config["writer"] is None


def test_fast_writers_are_refused_on_cpu_ranks():
    from trainer.errors import ConfigError
    for writer in ("fast", "decoupled"):
        with pytest.raises(ConfigError, match=f"train.checkpoint_writer={writer} does not run on CPU"):
            resolved_for(2, f"train.checkpoint_writer={writer}")
