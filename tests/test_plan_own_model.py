"""`plan` on a model no preset ships (a Qwen2-0.5B-sized config.json written here, no downloads): the launch line is
train.py with the nearest shipped preset and the `--set` items that make it this model and the plan, it resolves
with the project's resolver and `lint` finds no error or warning in it; `--write-preset` writes it as a preset
file that `presets`, `show` and `lint` take at once."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from trainer import ds as dsc
from trainer.__main__ import main
from trainer.diagnose.lint import lint_resolved
from trainer.plan.decide import make_plan
from trainer.plan.inputs import build_inputs
from trainer.presets import list_presets, load_preset
from trainer.resolve import resolve

ROOT = Path(__file__).resolve().parent.parent
QWEN2_05B = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
             "max_position_embeddings": 32768, "tie_word_embeddings": True, "rope_theta": 1000000.0}
FOUR_4090 = {"gpu": "rtx4090", "gpus_per_node": 4, "seq_len": 4096}


@pytest.fixture
def qwen(tmp_path) -> Path:
    (tmp_path / "qwen").mkdir()
    path = tmp_path / "qwen" / "config.json"
    path.write_text(json.dumps(QWEN2_05B))
    return path


def launch_items(line: str) -> tuple[str, list[str]]:
    """The preset and the --set items of a printed launch line."""
    words = shlex.split(line)
    return words[words.index("--preset") + 1], [words[i + 1] for i, w in enumerate(words) if w == "--set"]


def resolved_launch(plan):
    assert " train.py --preset " in plan.launch and "your_train" not in plan.launch, plan.launch
    preset, overrides = launch_items(plan.launch)
    assert preset == plan.preset and overrides == plan.preset_overrides
    return resolve(load_preset(preset, overrides))


def complaints(resolved) -> list[str]:
    return [f"{f.severity}: {f.message}" for f in lint_resolved(resolved) if f.severity in ("error", "warn")]


@pytest.mark.parametrize("task", ["full", "lora", "pretrain"])
def test_the_launch_line_trains_this_model_as_planned_and_lints_clean(qwen, task):
    plan = make_plan(build_inputs({"model": str(qwen), "task": task, **FOUR_4090}))
    r = resolved_launch(plan)
    m, c = r.config.model, plan.choice
    assert (m.family, m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size,
            m.tie_word_embeddings, m.rope_theta) == ("qwen2", 896, 24, 14, 2, 4864, 151936, True, 1e6)
    assert m.name_or_path == (None if task == "pretrain" else str(qwen.parent.resolve()))
    assert m.lora.enabled == (task == "lora")
    assert (r.config.hardware.gpu, r.world_size, r.config.data.seq_len) == ("rtx4090", 4, 4096)
    assert dsc.zero_stage(r.ds) == c.candidate.stage and r.batch.micro_batch_size == c.micro_batch
    assert m.gradient_checkpointing == c.checkpointing
    assert dsc.offload_optimizer_device(r.ds) == c.candidate.offload_optimizer
    assert complaints(r) == []


def test_a_shipped_moe_config_gets_a_line_of_this_project_too():
    """The issue's second case: presets/models/qwen3_30b_a3b/config.json fully fine-tuned (its preset is LoRA)."""
    plan = make_plan(build_inputs({"model": str(ROOT / "presets/models/qwen3_30b_a3b/config.json"), "task": "full",
                                   "gpu": "h100", "gpus_per_node": 8}))
    r = resolved_launch(plan)
    assert (r.config.model.family, r.config.model.num_experts, r.config.model.lora.enabled) == ("qwen3_moe", 128, False)
    assert not [f for f in lint_resolved(r) if f.severity == "error"]


def test_write_preset_writes_a_preset_presets_show_and_lint_take_at_once(qwen, tmp_path, capsys):
    target = tmp_path / "presets" / "qwen2_05b_4x4090.yaml"
    target.parent.mkdir()
    args = ["--model", str(qwen), "--gpu", "rtx4090", "--gpus-per-node", "4", "--seq-len", "4096", "--task", "full"]
    assert main(["plan", *args, "--write-preset", str(target)]) == 0
    printed = capsys.readouterr()
    assert f"wrote {target}" in printed.err
    launch = next(line for line in printed.out.splitlines() if line.startswith("Launch: "))
    text = target.read_text()
    lines = [line[2:] for line in text.splitlines() if line.startswith("# ")]
    assert lines[0].startswith("qwen2_05b_4x4090 — full fine-tune of")
    for label in ("Hardware:", "Model:", "Trade-off:", "Expected memory per GPU: ~", "Launch:"):
        assert any(line.startswith(label) for line in lines), (label, lines)
    assert ("qwen2_05b_4x4090", "") != list_presets(target.parent)[0] and \
        list_presets(target.parent)[0][0] == "qwen2_05b_4x4090"
    # the file is the launch line: the same resolved config but for its own name, description and run directory
    written, printed_line = resolve(load_preset(str(target))), resolve(load_preset(*launch_items(launch)))
    assert written.ds == printed_line.ds and written.config.model == printed_line.config.model
    assert written.config.train.output_dir == "runs/qwen2_05b_4x4090"
    header_launch = next(line for line in lines if line.startswith("Launch: "))
    from trainer.launch.command import command_for
    assert header_launch == f"Launch: {command_for(written, str(target), [])}"
    assert main(["show", str(target)]) == 0 and "name: qwen2_05b_4x4090" in capsys.readouterr().out
    assert main(["lint", str(target)]) == 0
    linted = capsys.readouterr().out
    expected = re.search(r"Expected memory per GPU: ~([\d.]+) GB of 22.9", text).group(1)
    assert "0 error(s), 0 warning(s)" in linted and f"planner: {expected} GB per GPU of 22.9 usable" in linted


def test_write_preset_refuses_a_shipped_preset_and_a_non_yaml_file(qwen, capsys):
    args = ["plan", "--model", str(qwen), "--gpu", "rtx4090", "--gpus-per-node", "4"]
    assert main([*args, "--write-preset", str(ROOT / "presets" / "7b_8xa100.yaml")]) == 2
    assert "a shipped preset; write a new name" in capsys.readouterr().err
    assert main([*args, "--write-preset", "mine.json"]) == 2
    assert re.search(r"\.yaml", capsys.readouterr().err)
    assert (ROOT / "presets" / "7b_8xa100.yaml").read_text().startswith("# 7b_8xa100")


@pytest.mark.parametrize("values", [{"task": "full", **FOUR_4090}, {"task": "lora", "gpu": "l4", "gpus_per_node": 8}],
                         ids=["qwen2-full-4x4090", "qwen2-lora-8xl4"])
def test_lint_does_not_object_to_the_stage_the_plan_chose(qwen, values):
    """The issue's case: ZeRO-0 with checkpointing (17.8 GB) was planned where ZeRO-2 fits without (16.4 GB), and
    lint noted that stage 2 has the same communication; both now read one rule (stage_below_two_wasted)."""
    plan = make_plan(build_inputs({"model": str(qwen), **values}))
    assert plan.choice.candidate.stage == 2 and plan.walk[0].startswith("zero0: skipped on")
    notes = [f.message for f in lint_resolved(resolved_launch(plan)) if f.check.startswith("#2")]
    assert len(notes) == 1 and notes[0].startswith("planner: "), notes


def test_one_gpu_keeps_stage_0_where_there_is_nothing_to_shard():
    plan = make_plan(build_inputs({"model": "7b", "gpu": "rtx4090", "gpus_per_node": 1, "task": "lora"}))
    assert plan.choice.candidate.stage == 0


TINY_CONFIG = {**QWEN2_05B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 1024, "max_position_embeddings": 4096}


@pytest.mark.multirank
def test_the_make_it_yours_journey_runs_end_to_end_on_a_tiny_config_json(tmp_path, capsys):
    """docs/make-it-yours.md, "Your model on your GPUs": a config.json and 4 GPUs -> plan --write-preset -> lint ->
    the header's rehearsal line on 2 CPU ranks -> the header's launch line, which the launcher parses."""
    from distributed import launch, read_metrics
    from trainer.launch.command import command_for
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text(json.dumps(TINY_CONFIG))
    target = tmp_path / "presets" / "mine_4x4090.yaml"
    target.parent.mkdir()
    assert main(["plan", "--model", str(tmp_path / "mine" / "config.json"), "--gpu", "rtx4090", "--gpus-per-node",
                 "4", "--seq-len", "4096", "--task", "full", "--write-preset", str(target)]) == 0
    capsys.readouterr()
    assert main(["lint", str(target)]) == 0
    assert "0 error(s), 0 warning(s)" in capsys.readouterr().out
    header = [line[2:] for line in target.read_text().splitlines() if line.startswith("# ")]
    check = next(line for line in header if line.startswith("Check it: "))
    rehearse = shlex.split(check[check.index("deepspeed --num_gpus 2 "):])
    assert rehearse[3:] == ["train.py", "--preset", str(target), "--rehearse"]
    run = tmp_path / "run"
    output = launch([*rehearse[3:], "--set", f"train.output_dir={run}"])
    assert "rehearsal of mine_4x4090" in output
    assert read_metrics(run)[0][-1]["step"] == 6
    written = resolve(load_preset(str(target)))
    assert f"Launch: {command_for(written, str(target), [])}" in header
