"""scripts/gpu_check.py on CPU: arguments, the refusal without a GPU, the plan (work counts, estimates, budgets,
the total against 480 s), items measured in processes of their own and every outcome in the report, a forced
tiny budget that leaves no process, what runs when flash-attn is missing, the ops preflight builds, versions vs
pins, the arch list DeepSpeed can read, the planner rows and synthetic data it uses, and a --cpu-dry-run end to
end. No ranks; the tests that start processes or build a model are marked slow."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check as gc  # noqa: E402
import gpu_check_fakes as fakes  # noqa: E402
import gpu_check_items as gi  # noqa: E402
from trainer.presets import with_overrides  # noqa: E402

from trainer.errors import UserError  # noqa: E402
from trainer.plan import memory as mem  # noqa: E402
from trainer.plan.estimate import plan_for_resolved  # noqa: E402
from trainer.presets import load_preset  # noqa: E402
from trainer.resolve import resolve  # noqa: E402


SCRIPT = ROOT / "scripts" / "gpu_check.py"
ENV_PYTHONPATH = {"PYTHONPATH": str(ROOT)}


def run_script(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **ENV_PYTHONPATH})


def item(name, prepare=None, measure=None):
    """A test item: `measure` runs in a spawned process, so it is a module-level function of this file."""
    return gc.Item(name, f"what {name}", f"goal {name}", prepare or (lambda ctx: {"work": {"interpreter": 2}}),
                   measure or fakes.measure_fine)


def boom(ctx):
    raise ValueError("boom in prepare")


def quiet(*args, **kwargs):
    pass


# ============================================================================================ arguments

def test_arguments_defaults_and_item_names():
    args = gc.parse_args([])
    assert (args.output, args.cpu_dry_run, args.only, args.skip, args.port) == ("gpu_check.json", False, [], [], 30500)
    args = gc.parse_args(["--cpu-dry-run", "--only", "memory, throughput", "--skip", "kernels", "-o", "r.json"])
    assert args.cpu_dry_run and args.only == ["memory", "throughput"] and args.skip == ["kernels"]


def test_unknown_item_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exc:
        gc.parse_args(["--only", "memroy"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown item(s) memroy" in err and "throughput" in err and "gpu_tests" in err


@pytest.mark.slow  # starts processes or builds a model (issue 36's tiers)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the script does not refuse here")
def test_refuses_on_cpu_without_the_dry_run_flag(tmp_path):
    report = tmp_path / "report.json"
    proc = run_script("-o", str(report))
    assert proc.returncode == 2
    assert "no CUDA GPU is visible" in proc.stderr and "--cpu-dry-run" in proc.stderr
    assert not report.exists()


@pytest.mark.slow  # starts processes or builds a model (issue 36's tiers)
def test_an_unwritable_report_path_is_refused_before_any_work(tmp_path):
    proc = run_script("--cpu-dry-run", "-o", str(tmp_path / "missing" / "r.json"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert "[preflight]" not in proc.stdout


# ============================================================================================ report

def ctx(tmp_path, dry_run=False) -> gc.Context:
    return gc.Context(tmp_path, dry_run)


@pytest.mark.slow  # starts processes or builds a model (issue 36's tiers)
def test_each_item_runs_in_its_own_process_and_every_outcome_reaches_the_report(tmp_path):
    """Measured in spawned processes (the real path): passed, missed, a raising prepare, an unknown status, NaN
    measurements, a partly failed item keeping what it measured, and an item not asked for."""
    items = (item("fine"), item("raising", prepare=boom), item("short", measure=fakes.measure_low),
             item("odd", measure=fakes.measure_odd), item("nan", measure=fakes.measure_nan), item("half", measure=fakes.measure_half),
             item("not_asked"))
    args = gc.parse_args([])
    args.skip = ["not_asked"]
    context = ctx(tmp_path)
    written = []
    rows = gc.run_all(items, gc.plan_all(items, context, args), context, echo=quiet,
                      after_each=lambda done: written.append([r["status"] for r in done]))
    report = gc.make_report(rows, context, 0.0, 12.5)
    assert report["schema"] == gc.SCHEMA and report["exit_code"] == gc.EXIT_ERROR
    assert set(report) >= {"started", "finished", "duration_s", "budget_s", "planned_s", "unit_seconds", "dry_run",
                           "device", "torch", "code", "items"}
    by_name = {r["name"]: r for r in report["items"]}
    for row in by_name.values():
        assert set(row) >= {"name", "status", "duration_s", "budget_s", "estimate_s", "work", "measurements", "goal",
                            "verdict", "reason"}
        assert row["status"] in gc.STATUSES
    assert by_name["fine"]["status"] == "passed" and by_name["fine"]["measurements"]["value"] == 1
    assert by_name["fine"]["budget_s"] == gc.budget_for(gc.items_mod.UNIT_SECONDS["interpreter"] * 2)
    assert by_name["raising"]["status"] == "error"
    assert "prepare failed: ValueError: boom in prepare" in by_name["raising"]["verdict"]
    assert by_name["short"]["status"] == "missed"
    assert by_name["odd"]["status"] == "error" and "unknown status 'great'" in by_name["odd"]["verdict"]
    assert by_name["half"]["status"] == "error" and "z3_ckpt_mb2: exit 1" in by_name["half"]["verdict"]
    assert by_name["half"]["measurements"]["rows"] == [{"name": "z2_mb1", "ratio": 1.02}]
    assert by_name["not_asked"]["status"] == "skipped" and by_name["not_asked"]["reason"] == "--skip on the command line"
    assert len(written) == 5 and written[-1] == [r["status"] for r in rows]  # the report after every measured item
    text = gc.table(report)
    assert "FAILED: raising, odd, half" in text and "goal missed: short, nan" in text
    path = gc.write_report(report, str(tmp_path / "report.json"))
    nan = json.loads(path.read_text())["items"][4]["measurements"]
    assert nan["loss"] == [1.0, "nan"] and nan["mfu"] == "inf"  # a diverged loss does not cost the report
    with pytest.raises(UserError, match="-o"):
        gc.write_report(report, str(tmp_path))  # a directory


def test_exit_codes():
    def rows(*statuses):
        return [{"status": s} for s in statuses]
    assert gc.exit_code(rows("passed", "skipped")) == gc.EXIT_OK
    assert gc.exit_code(rows("passed", "missed")) == gc.EXIT_MISSED
    assert gc.exit_code(rows("missed", "timeout")) == gc.exit_code(rows("error")) == gc.EXIT_ERROR


def test_main_names_the_failing_item_and_exits_non_zero(tmp_path, capsys):
    code = gc.main(["--cpu-dry-run", "-o", str(tmp_path / "r.json"), "--workdir", str(tmp_path / "w")],
                   items=(item("fine"), item("raising", prepare=boom)))
    assert code == gc.EXIT_ERROR
    captured = capsys.readouterr()
    assert "FAILED items: raising" in captured.err and "FAILED: raising" in captured.out
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["status"] for r in report["items"]] == ["skipped", "error"]
    assert report["items"][0]["reason"].startswith("--cpu-dry-run")


# ============================================================================================ budget

def test_budgets_follow_the_work_counts_with_the_margin():
    work = {"launch": 2, "op_build:fused_adam": 1, "tokens_1b_k": 100}
    seconds = gi.UNIT_SECONDS
    estimate = 2 * seconds["launch"] + gi.OP_BUILD_SECONDS["fused_adam"] + 100 * seconds["tokens_1b_k"]
    assert gi.estimate_seconds(work) == pytest.approx(estimate)
    assert gc.budget_for(estimate) >= estimate * gc.MARGIN and gc.budget_for(estimate) % gc.BUDGET_STEP_S == 0
    assert gi.estimate_seconds({"op_build:an_op_nobody_timed": 1}) == gi.OP_BUILD_DEFAULT_S
    with pytest.raises(KeyError, match="'lunch' has no seconds"):
        gi.estimate_seconds({"lunch": 1})
    rows = [{"name": "a", "work": {"launch": 1}, "estimate_s": 300.0, "budget_s": 450.0, "prepare_s": 10.0,
             "reason": "", "verdict": ""},
            {"name": "b", "work": {}, "estimate_s": 0.0, "budget_s": 0.0, "prepare_s": 0.0, "reason": "--skip",
             "verdict": ""}]
    assert gc.plan_total(rows) == 460.0
    assert gc.plan_table(rows).endswith("of the 480 s budget: fits") and "--skip" in gc.plan_table(rows)
    assert gc.plan_table(rows, total=400).endswith("OVER")


@pytest.mark.slow  # starts processes or builds a model (issue 36's tiers)
def test_a_timed_out_item_is_stopped_with_everything_it_started(tmp_path):
    """A forced tiny budget: the item ends `timeout`, and nothing carrying its marker runs afterwards (the
    child, its grandchild and the daemon that left the session)."""
    from trainer.process_tree import leftovers
    stuck = item("stuck", prepare=lambda c: {"work": {"interpreter": 0.1}}, measure=fakes.measure_stuck_with_a_tree)
    context = ctx(tmp_path)
    row = gc.plan_item(stuck, context, None)
    row["budget_s"] = 4.0
    started = time.monotonic()
    gc.measure_item(stuck, context, row)
    assert row["status"] == "timeout" and 4 <= row["duration_s"] < 30
    assert "ran past its 4 s budget" in row["verdict"] and row["left_running"] == []
    assert int(row["verdict"].split("stopped ")[1].split()[0]) >= 4  # the item, child, grandchild, daemon
    assert leftovers(f"stuck-{os.getpid()}") == []
    assert time.monotonic() - started < 30
    assert gc.exit_code([row]) == gc.EXIT_ERROR and "TIMED OUT: stuck" in gc.table(
        gc.make_report([row], context, 0, 5))


# ============================================================================================ plan rows

@pytest.fixture(scope="module")
def dry_ctx(tmp_path_factory):
    return gc.Context(tmp_path_factory.mktemp("gpu_check"), dry_run=True, flash=True, liger=True)


def installed_here(tmp_path, flash: bool, liger: bool) -> gc.Context:
    return gc.Context(tmp_path, dry_run=False, device_name="NVIDIA H200", gpu_count=1, flash=flash, liger=liger)


@pytest.mark.slow  # starts processes or builds a model (issue 36's tiers)
def test_memory_rows_cover_the_configurations_and_carry_the_planners_numbers(dry_ctx):
    prepared = gi.prepare_memory(dry_ctx)
    rows = prepared["rows"]
    assert len(rows) >= 4
    for key, values in (("stage", {2, 3}), ("checkpointing", {False, True}), ("micro_batch", {1, 2}),
                        ("liger", {False, True})):
        assert {r[key] for r in rows} == values, key
    for row in rows:
        resolved = resolve(load_preset(gi.PRESET, row["overrides"]), 1)
        cfg = resolved.config
        assert resolved.summary()["zero_stage"] == row["stage"] and cfg.train.micro_batch_size == row["micro_batch"]
        assert (cfg.model.gradient_checkpointing, cfg.model.liger) == (row["checkpointing"], row["liger"])
        assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.data.seq_len) == (gi.MEMORY_LAYERS, 2048, 4096)
        estimate = plan_for_resolved(resolved, attention="flash_attention_2")
        assert row["planned"]["total"] == estimate.gpu_total
        assert row["planned"]["logits"] == mem.logits_bytes(cfg.model, 4096, row["micro_batch"])
        if row["liger"]:
            assert row["planned"]["logits"] < 12 * 4096 * row["micro_batch"] * 128256 / 10
        else:
            assert row["planned"]["logits"] == 12 * 4096 * row["micro_batch"] * 128256


@pytest.mark.slow  # starts processes or builds a model (issue 36's tiers)
def test_throughput_plan_uses_the_1b_shape_and_a_micro_batch_that_fits(dry_ctx):
    prepared = gi.prepare_throughput(dry_ctx)
    assert prepared["num_params"] == mem.count_params(load_preset(gi.PRESET).model) == 1_235_814_400
    assert prepared["gpu"] == "h200" and prepared["micro_batch"] == 4 and prepared["seq_len"] == 4096
    assert prepared["planned_gpu_bytes"] < 139.8 * 2**30 * 0.9
    assert set(prepared["variants"]) == {"sdpa", "flash_liger"}
    assert prepared["variants"]["flash_liger"]["contenders"] == ["minimal", "trainer", "hf_trainer"]
    for name, variant in prepared["variants"].items():
        cmd = variant["command"]
        assert cmd[cmd.index("--steps") + 1] == str(gi.STEPS) and cmd[cmd.index("--warmup") + 1] == str(gi.WARMUP)
        assert f"model.attn_implementation={variant['attention']}" in cmd
        assert variant["resolved"]["precision"] == "bf16" and variant["resolved"]["world_size"] == 1
    # the work: one launch per contender, each building the 1B model and running STEPS steps of 4 x 4096 tokens
    assert prepared["work"]["launch"] == prepared["work"]["model_1b"] == 4
    assert prepared["work"]["tokens_1b_k"] == pytest.approx(4 * gi.STEPS * 4 * 4096 / 1000)
    assert prepared["ops"] == ["fused_adam"]


@pytest.mark.parametrize("flash, liger, rounds, skipped", [
    (True, True, {"flash_liger": 3, "sdpa": 1}, {"sdpa_liger"}),
    (False, True, {"sdpa_liger": 3}, {"flash_liger", "sdpa"}),  # what the H200 of 2026-12-04 ran
    (False, False, {"sdpa": 3}, {"flash_liger", "sdpa_liger"}),
])
def test_throughput_rounds_follow_the_kernels_installed(tmp_path, flash, liger, rounds, skipped):
    planned, why = gi.throughput_rounds(installed_here(tmp_path, flash, liger))
    assert {name: len(r[2].split(",")) for name, r in planned.items()} == rounds
    assert set(why) == skipped
    if not flash:
        assert "flash-attn is not installed" in why["flash_liger"] and "--no-build-isolation" in why["flash_liger"]


def test_without_flash_attn_the_kernels_item_checks_liger_alone(tmp_path):
    prepared = gi.prepare_kernels(installed_here(tmp_path, flash=False, liger=True))
    assert [r["name"] for r in prepared["runs"]] == ["sdpa", "fast"] and not prepared["skip"]
    assert "model.attn_implementation=sdpa" in prepared["runs"][1]["overrides"]
    assert set(prepared["skipped"]) == {"flash_attn"}
    none = gi.prepare_kernels(installed_here(tmp_path, flash=False, liger=False))
    assert "flash-attn" in none["skip"] and "liger-kernel" in none["skip"]  # planned as skipped: no process


def test_fp16_item_takes_the_v100_presets_loss_scaling_block(dry_ctx):
    cmd = gi.prepare_fp16(dry_ctx)["command"]
    value = next(c for c in cmd if c.startswith("deepspeed.fp16="))
    block = yaml.safe_load(value.split("=", 1)[1])
    assert block == load_preset("7b_2xv100").deepspeed["fp16"]
    assert block["loss_scale"] == 0  # 0 = dynamic loss scaling


def test_zeropp_is_skipped_with_its_reason_on_one_gpu(tmp_path):
    one = gc.Context(tmp_path, dry_run=False, device_name="NVIDIA H200", gpu_count=1)
    zeropp = next(i for i in gc.ITEMS if i.name == "zeropp")
    row = gc.plan_item(zeropp, one, None)
    assert row["status"] == "skipped" and "one GPU" in row["reason"] and row["budget_s"] == 0
    assert gc.measure_item(zeropp, one, row) is row and row["status"] == "skipped"  # no process started
    two = gc.Context(tmp_path, dry_run=False, device_name="NVIDIA H200", gpu_count=2)
    assert gc.plan_item(zeropp, two, None)["work"] == {"launch": 1, "step_tiny": gi.TINY_STEPS}


# ============================================================================================ preflight

def test_versions_found_are_reported_next_to_the_pins_not_refused():
    pins = gi.pinned_versions()
    assert pins["torch"] == "2.13.0" and pins["deepspeed"] == "0.19.8" and pins["transformers"] == "5.24.0"
    assert pins["liger-kernel"] == "0.8.5"
    found = {"torch": {"found": "2.11.0+cu130", "pinned": "2.13.0"}, "deepspeed": {"found": "0.19.8", "pinned": "0.19.8"},
             "flash_attn": {"found": None, "pinned": None}, "tokenizers": {"found": None, "pinned": "0.23.3"}}
    assert gi.differs(found) == ["torch 2.11.0+cu130 (pinned 2.13.0)", "tokenizers missing (pinned 0.23.3)"]
    here = gi.stack_versions()
    assert here["torch"] == {"found": importlib.metadata.version("torch"), "pinned": "2.13.0"}


def test_preflight_builds_every_op_the_planned_items_load(dry_ctx):
    args = gc.parse_args(["--cpu-dry-run", "--only", "preflight,fp16,inference"])
    rows = {r["name"]: r for r in gc.plan_all(gc.ITEMS, dry_ctx, args)}
    prepared = rows["preflight"]["measurements"]["prepared"]
    assert prepared["ops"] == ["fused_adam", "transformer_inference"]  # fp16's optimizer, inference's injection
    assert rows["preflight"]["work"] == {"interpreter": 1, "op_build:fused_adam": 1,
                                         "op_build:transformer_inference": 1}


def test_flash_attention_is_detected_as_transformers_detects_it():
    from transformers.utils import is_flash_attn_2_available

    from trainer.config import ModelConfig
    from trainer.model import choose_attention, flash_attention_available
    assert flash_attention_available() == is_flash_attn_2_available()
    if not torch.cuda.is_available():
        assert not flash_attention_available()
        assert choose_attention(ModelConfig(attn_implementation="auto")) == "sdpa"
        assert choose_attention(ModelConfig(attn_implementation="flash_attention_2")) == "sdpa"


@pytest.mark.parametrize("value, fixed", [
    ("9.0a", "9.0"),                                  # the H200 image's value: every op build failed on it
    ("8.0;9.0a;10.0a+PTX", "8.0;9.0;10.0+PTX"),
    ("7.5 8.0+PTX", "7.5 8.0+PTX"),                   # already readable: left as set
])
def test_arch_lists_deepspeed_cannot_read_are_rewritten(value, fixed):
    from trainer import jit_env
    environ = {"TORCH_CUDA_ARCH_LIST": value}
    jit_env.arch_list_for_deepspeed(environ)
    assert environ["TORCH_CUDA_ARCH_LIST"] == fixed
    assert environ.get("TRAINER_TORCH_CUDA_ARCH_LIST_AS_SET") == (None if value == fixed else value)
    for entry in fixed.replace(" ", ";").split(";"):  # what DeepSpeed 0.19.8's compute_capability_args does
        tuple(int(part.split("+")[0]) for part in entry.split("."))


# ============================================================================================ gpu tests

def test_the_gpu_tests_work_is_read_from_their_source():
    tests = gi.gpu_test_plan()
    assert tests["test_liger_kernels_train_like_plain_llama"]["work"] == {"launch": 2}
    assert tests["test_kernel_injected_generation_matches_plain"]["ops"] == [gi.INJECTION_OP]
    assert tests["test_flash_attention_trains_like_sdpa"]["needs_flash"]
    assert not tests["test_zeropp_quantized_weights_train"]["needs_flash"]
    assert set(gi.COVERED_BY_ITEMS) <= set(tests)


@pytest.mark.slow  # starts processes or builds a model (issue 36's tiers)
def test_the_gpu_tests_item_deselects_what_cannot_run_or_an_item_runs(tmp_path):
    prepared = gi.prepare_gpu_tests(installed_here(tmp_path, flash=False, liger=True))
    assert set(prepared["deselected"]) == {"test_fp16_dynamic_loss_scaling_logs_the_scale",
                                           "test_flash_attention_trains_like_sdpa"}
    keyword = prepared["command"][prepared["command"].index("-k") + 1]
    assert keyword == " and ".join(f"not {name}" for name in prepared["deselected"])
    assert gi.INJECTION_OP in prepared["ops"] and "fused_adam" in prepared["ops"]
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                str(gi.GPU_TESTS), "-k", keyword], cwd=ROOT, capture_output=True, text=True,
                               timeout=120)
    names = {line.split("::")[-1] for line in collected.stdout.splitlines() if "::" in line}
    assert names == set(prepared["tests"])  # pytest runs exactly the tests the plan counted


# ============================================================================================ synthetic data

def test_synthetic_corpus_is_deterministic(tmp_path):
    a = gi.write_synthetic_corpus(tmp_path / "a.jsonl", 3, 64).read_bytes()
    b = gi.write_synthetic_corpus(tmp_path / "b.jsonl", 3, 64).read_bytes()
    c = gi.write_synthetic_corpus(tmp_path / "c.jsonl", 3, 64, seed=1).read_bytes()
    assert a == b != c and len(a.splitlines()) == 4


def test_synthetic_batches_have_the_shapes_and_dtypes_training_reads(tmp_path):
    batches = []
    for run in ("one", "two"):
        context = gc.Context(tmp_path / run, dry_run=True)
        context.workdir.mkdir()
        corpus = gi.write_synthetic_corpus(context.workdir / "corpus.jsonl", 4, 128)
        batches.append(gi.synthetic_batch(gi.base_overrides(context, 2) + gi.synthetic_overrides(context, corpus, 128)))
    first, second = batches
    assert first == second  # separately prepared caches, the same first micro-batch
    assert first["input_ids"] == {**first["input_ids"], "shape": [2, 128], "dtype": "torch.int64"}
    assert first["labels"]["shape"] == [2, 128] and first["input_ids"]["max"] < 1024  # the tiny tokenizer's ids


# ============================================================================================ parsing helpers

def test_kernel_names_are_told_apart():
    names = ["void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4>, true>(Flash_fwd_params)",
             "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4>, true>(Flash_fwd_params)",
             "_rms_norm_forward_kernel", "_swiglu_backward_kernel", "liger_cross_entropy_kernel",
             "void at::native::vectorized_elementwise_kernel<4, at::native::rms_norm_kernel>(int)", "ampere_sgemm",
             "void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>(Flash_bwd_params)",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "aten::cross_entropy_loss",
             "aten::_scaled_dot_product_flash_attention", "ScaledDotProductFlashAttentionBackward0"]
    assert gi.flash_attn_kernels(names) == sorted([names[0], names[7]])
    assert gi.liger_kernels(names) == ["_rms_norm_forward_kernel", "_swiglu_backward_kernel",
                                       "liger_cross_entropy_kernel"]


SHRUNK = ["hardware.gpu=cpu", "train.precision=fp32", "model.hidden_size=64", "model.intermediate_size=128",
          "model.num_heads=4", "model.num_kv_heads=2", "model.vocab_size=1024", "data.seq_len=64"]


@pytest.mark.slow  # starts processes or builds a model (issue 36's tiers)
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels item itself runs this worker")
def test_the_kernels_worker_on_cpu_sees_no_flash_or_liger_and_the_item_says_so(dry_ctx):
    """The worker's real plumbing (build_model, profiler, classification) on a shrunk model: on CPU flash-attn and
    Liger fall back to sdpa and torch, which is exactly what the checks must catch (a silent fallback)."""
    spec = gi.prepare_kernels(dry_ctx)
    for run in spec["runs"]:
        run["overrides"] = with_overrides(run["overrides"], SHRUNK)  # the shrunk values replace the item's
    found = gi.kernels_worker(spec)
    assert found["fast"]["attention"] == "sdpa" and found["fast"]["kernel_count"] > 10
    assert found["fast"]["flash_attn_kernels"] == found["fast"]["liger_kernels"] == []
    checks = gi.kernel_checks(found, spec["expects"])
    assert not checks["attention is flash_attention_2"] and not checks["flash_attn kernels ran"]
    assert not checks["Liger kernels ran"] and checks["the sdpa run had neither"]


def test_pytest_summary_counts():
    out = "....s\nSKIPPED [1] tests/test_gpu.py:27: flash-attn is not installed\n4 passed, 1 skipped in 61.2s\n"
    assert gi.pytest_counts(out) == {"passed": 4, "failed": 0, "skipped": 1, "error": 0}
    assert gi.pytest_counts("1 failed, 2 passed, 1 error in 3s") == {"passed": 2, "failed": 1, "skipped": 0,
                                                                     "error": 1}


@pytest.mark.slow  # starts processes or builds a model (issue 36's tiers)
def test_the_trainers_kernels_line_is_read_from_a_launch_log(tmp_path):
    from trainer.model import build_model, kernels_in_use
    cfg = resolve(load_preset("tiny_cpu", ["hardware.gpus_per_node=1"]), 1).config
    model, _ = build_model(cfg, 0)
    log = tmp_path / "trainer_0.log"
    log.write_text(f"noise\n[rank0]: model: 3,000 parameters (3,000 trainable); {kernels_in_use(model)}\nmore\n")
    assert gi.kernels_line(log) == "attention sdpa, liger off"


# ============================================================================================ end to end

@pytest.mark.slow  # starts processes or builds a model (issue 36's tiers)
def test_cpu_dry_run_end_to_end(tmp_path):
    """The plan for one H200 with the full stack: every item's work, estimate and budget, the total against the
    budget, and no measurement. With no budget to speak of every item is planned; with the default 480 s the plan
    fits, and the items that would not are deferred with the command that runs them next."""
    def dry_run(*flags: str) -> tuple[dict, str]:
        report_path = tmp_path / f"report{len(flags)}.json"
        proc = run_script("--cpu-dry-run", "-o", str(report_path), "--workdir", str(tmp_path / "work"), *flags,
                          timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(report_path.read_text()), proc.stdout
    report, stdout = dry_run("--budget", "100000")
    assert report["dry_run"] is True and report["exit_code"] == 0
    assert [r["name"] for r in report["items"]] == [i.name for i in gc.ITEMS]
    for row in report["items"]:
        assert row["status"] == "skipped" and row["measurements"]["prepared"], row["name"]
        assert f"\n{row['name']:<11} skipped" in stdout  # its line in the table
        if row["name"] == "zeropp":
            assert "one GPU" in row["reason"] and row["budget_s"] == 0
            continue
        assert row["reason"].startswith("--cpu-dry-run"), row
        assert row["estimate_s"] > 0 and row["estimate_s"] == pytest.approx(gi.estimate_seconds(row["work"]), abs=0.1)
        assert row["budget_s"] == gc.budget_for(gi.estimate_seconds(row["work"]))
        assert f"\n{row['name']:<11} {row['estimate_s']:>8.0f} {row['budget_s']:>6.0f}  " in stdout  # plan line
    assert report["planned_s"] == pytest.approx(gc.plan_total(report["items"]), abs=0.5)
    throughput = next(r for r in report["items"] if r["name"] == "throughput")["measurements"]["prepared"]
    assert throughput["synthetic_batch"]["input_ids"]["shape"] == [4, gi.DRY_SEQ_LEN]
    assert "cpu dry run: nothing measured" in stdout
    everything = {r["name"]: r for r in report["items"]}

    report, stdout = dry_run()
    assert report["planned_s"] <= gc.TOTAL_BUDGET_S and "of the 480 s budget: fits" in stdout
    deferred = [r["name"] for r in report["items"] if r["reason"].startswith("deferred:")]
    assert deferred and everything["preflight"]["budget_s"] + sum(  # nothing deferred that would have fitted
        everything[r["name"]]["budget_s"] for r in report["items"] if r["reason"].startswith("--cpu-dry-run")
        and r["name"] != "preflight") + everything[deferred[0]]["budget_s"] > gc.TOTAL_BUDGET_S
    for row in report["items"]:
        if row["name"] in deferred:
            assert f"run it next: scripts/gpu_check.py --only preflight,{','.join(deferred)}" in row["reason"]
        elif row["name"] != "zeropp":
            assert row["budget_s"] == everything[row["name"]]["budget_s"] or row["name"] == "preflight"
