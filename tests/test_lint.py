"""`python -m trainer lint`: the seed's tuning checklist on resolved presets. Fast: no ranks."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from trainer.diagnose.lint import lint_resolved
from trainer.presets import PRESET_DIR, load_preset
from trainer.resolve import resolve
from distributed import run_cli

PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def findings(preset: str, overrides: list[str] | None = None):
    return lint_resolved(resolve(load_preset(preset, overrides or [])))


def checks(found, severity: str | None = None) -> set[str]:
    return {f.check for f in found if severity is None or f.severity == severity}



@pytest.mark.parametrize("preset", PRESETS)
def test_lint_never_changes_the_config(preset):
    r = resolve(load_preset(preset))
    before = (copy.deepcopy(r.ds), copy.deepcopy(r.config))
    lint_resolved(r)
    assert (r.ds, r.config) == before


def test_cpu_offload_gets_the_bind_cores_advice():
    found = findings("70b_8xa100")
    assert any("--bind_cores_to_rank" in f.message for f in found if f.check == "#7 --bind_cores_to_rank")
    assert "#7 --bind_cores_to_rank" not in checks(findings("7b_8xa100"))


def test_multi_node_stage_3_without_hpz_gets_the_zeropp_advice():
    found = findings("70b_32xa100", ["deepspeed.zero_optimization.zero_hpz_partition_size=1"])
    zeropp = [f for f in found if f.check == "#9 ZeRO++"]
    assert zeropp and zeropp[0].severity == "warn" and "zero_hpz_partition_size=8" in zeropp[0].message
    assert "#9 ZeRO++" not in checks(findings("70b_32xa100"), "warn")  # the shipped preset has hpZ 8


def test_multi_node_below_stage_3_learns_zeropp_needs_stage_3():
    found = [f for f in findings("7b_8xa100", ["hardware.nodes=2"]) if f.check == "#9 ZeRO++"]
    assert found and found[0].severity == "info" and "stage 3" in found[0].message


def test_mixed_precision():
    assert "#1 mixed precision" in checks(findings("7b_8xa100", ["train.precision=fp32"]), "warn")
    fp16 = ["train.precision=fp16", "deepspeed.bf16=null",
            "deepspeed.fp16={enabled: auto, loss_scale: 0, initial_scale_power: 16}"]
    assert "#1 mixed precision" in checks(findings("7b_8xa100", fp16), "warn")
    assert "#1 mixed precision" not in checks(findings("7b_2xv100"))  # V100: fp16 is right
    assert "#1 mixed precision" not in checks(findings("tiny_cpu"))  # CPU ranks: fp32 is right


def test_overlap_comm_contiguous_gradients_and_pin_memory():
    found = findings("7b_8xa100", ["deepspeed.zero_optimization.overlap_comm=false",
                                   "deepspeed.zero_optimization.contiguous_gradients=false"])
    assert {"#4 overlap_comm", "contiguous gradients"} <= checks(found, "warn")
    unpinned = findings("70b_8xa100", ["deepspeed.zero_optimization.offload_optimizer={device: cpu, pin_memory: false}"])
    assert "#8 pin_memory" in checks(unpinned, "warn")


def test_long_sequences_without_checkpointing():
    """The seed's "a must for long sequences" where the planner does not show that it fits with room (on CPU ranks,
    or tight); where it does fit, the plan itself would leave checkpointing off, so lint does not object."""
    found = findings("1b_pretrain_8xh100", ["data.seq_len=8192", "train.micro_batch_size=4", "train.grad_accum=8"])
    assert "#6 activation checkpointing" in checks(found, "warn")
    roomy = findings("1b_pretrain_8xh100", ["data.seq_len=8192", "train.micro_batch_size=1", "train.grad_accum=32"])
    assert "#6 activation checkpointing" not in checks(roomy, "warn")


def test_bucket_sizes_outside_the_useful_range():
    found = findings("7b_8xa100", ["deepspeed.zero_optimization.reduce_bucket_size=1e6"])
    assert any(f.check == "bucket sizes" and "reduce_bucket_size" in f.message for f in found if f.severity == "warn")
    assert "bucket sizes" not in checks(findings("tiny_cpu"), "warn")  # CPU rehearsal sizes are for toy models


def test_nvme_without_pipelined_io(tmp_path):
    nvme = str(tmp_path)
    found = findings("7b_2xv100", [
        f"deepspeed.zero_optimization.offload_optimizer={{device: nvme, nvme_path: {nvme}, buffer_count: 4, "
        f"pin_memory: true}}",
        "deepspeed.aio={block_size: 1048576, queue_depth: 8}"])
    assert "#11 NVMe pipeline" in checks(found, "info")


def test_gradient_accumulation_vs_communication():
    stage2 = [f for f in findings("7b_8xa100") if f.check == "#5 gradient accumulation"]
    assert stage2 and "every micro-step" in stage2[0].message
    stage1 = [f for f in findings("7b_8xa100", ["deepspeed.zero_optimization.stage=1", "train.grad_accum=1",
                                                "train.micro_batch_size=8"]) if f.check == "#5 gradient accumulation"]
    assert stage1 and "once per optimizer step" in stage1[0].message


def test_a_preset_that_does_not_fit_is_an_error_and_exit_1():
    result = run_cli("lint", "7b_8xa100", "--set", "train.micro_batch_size=64", "--set",
                     "model.gradient_checkpointing=false")
    assert result.returncode == 1
    assert "ERROR [#2 ZeRO stage] will not fit" in result.stdout


def test_cli_json_and_clean_presets_exit_0():
    result = run_cli("lint", "70b_8xa100", "--json")
    assert result.returncode == 0
    found = json.loads(result.stdout)
    assert {f["severity"] for f in found} <= {"error", "warn", "info"}
    assert any(f["check"] == "#7 --bind_cores_to_rank" for f in found)


def test_sft_without_a_chat_template_on_a_hub_base_model_is_a_warning():
    assert "chat template" not in checks(findings("7b_8xa100"))  # the preset sets data.chat_template: llama-2
    found = [f for f in findings("7b_8xa100", ["data.chat_template=null"]) if f.check == "chat template"]
    assert found and found[0].severity == "warn"
    assert "base checkpoints ship none" in found[0].message and "set data.chat_template: chatml" in found[0].message
    # the tiny tokenizer is a local directory with a template; pretraining renders no chats
    assert "chat template" not in checks(findings("tiny_cpu", ["data.task=sft"]))
    assert "chat template" not in checks(findings("1b_pretrain_8xh100"))


def test_moe_layout_names_a_pretrained_moe_whose_blocks_the_trainer_cannot_find(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v2", "n_routed_experts": 64}))
    stage3 = ["deepspeed.zero_optimization.stage=3"]
    said = [f for f in findings("tiny_cpu", stage3 + [f"model.name_or_path={tmp_path}"]) if f.check == "MoE layout"]
    assert said and said[0].severity == "warn" and "set model.zero3_leaf_modules" in said[0].message
    assert "64 experts, model_type 'deepseek_v2'" in said[0].message
    named = [f for f in findings("tiny_cpu", stage3 + [f"model.name_or_path={tmp_path}",
                                                       "model.zero3_leaf_modules=[DeepseekV2MoE]"])
             if f.check == "MoE layout"]
    assert not named  # the user named its blocks: nothing to say


def test_moe_layout_suggests_autoep_for_mixtral_at_stage_3_and_not_when_it_is_on():
    said = [f for f in findings("mixtral_8x7b_8xa100", ["deepspeed.expert_parallel=null"]) if f.check == "MoE layout"]
    assert said and "autoep_size: 8}" in said[0].message and "1 per GPU" in said[0].message
    assert not [f for f in findings("mixtral_8x7b_8xa100") if f.check == "MoE layout"]


def test_sequence_parallel_mistakes():
    """SP not dividing the heads, eager attention and a seq_len the group cannot split are errors lint reports (from
    resolve, each with its fix); a group spanning nodes is a warning; a long share without tiled MLPs a note."""
    import contextlib
    import io

    from trainer.__main__ import main
    for mistake, says in ((["hardware.gpus_per_node=6", "deepspeed.sequence_parallel_size=3"], "use one of [1, 2]"),
                          (["deepspeed.sequence_parallel_size=2", "model.attn_implementation=eager"], "refuses 'eager'"),
                          (["deepspeed.sequence_parallel_size=2", "data.seq_len=127"], "use data.seq_len=126")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["lint", "tiny_cpu", *[word for item in mistake for word in ("--set", item)]])
        assert code != 0 and says in err.getvalue(), err.getvalue()
    across = findings("8b_128k_8xh100", ["hardware.gpus_per_node=4", "hardware.nodes=2"])
    assert any(f.check == "sequence parallel" and f.severity == "warn" and "cross the network" in f.message
               for f in across)
    assert "sequence parallel" not in checks(findings("8b_128k_8xh100"))  # one node, MLPs tiled
    untiled = [f for f in findings("8b_128k_8xh100", ["model.tiled_mlp=0"]) if f.check == "sequence parallel"]
    assert untiled and "model.tiled_mlp=4" in untiled[0].message
