"""scripts/gpu_check.py on CPU: arguments, the refusal without a GPU, the report and its fail-loudly exit codes,
the planner rows it will compare, the synthetic data path, the time budget and a --cpu-dry-run end to end.
Fast: in-process, plus two subprocesses of the script (no ranks)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check as gc  # noqa: E402
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


def item(name, prepare=lambda ctx: {"ok": True}, measure=None, budget=5.0):
    measure = measure or (lambda ctx, prepared, deadline: ("passed", {"value": 1}, "fine"))
    return gc.Item(name, budget, f"what {name}", f"goal {name}", prepare, measure)


def boom(ctx):
    raise ValueError("boom in prepare")


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


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the script does not refuse here")
def test_refuses_on_cpu_without_the_dry_run_flag(tmp_path):
    report = tmp_path / "report.json"
    proc = run_script("-o", str(report))
    assert proc.returncode == 2
    assert "no CUDA GPU is visible" in proc.stderr and "--cpu-dry-run" in proc.stderr
    assert not report.exists()


@pytest.mark.slow
def test_an_unwritable_report_path_is_refused_before_any_work(tmp_path):
    proc = run_script("--cpu-dry-run", "-o", str(tmp_path / "missing" / "r.json"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert "[preflight]" not in proc.stdout


# ============================================================================================ report

def ctx(tmp_path, dry_run=False) -> gc.Context:
    return gc.Context(tmp_path, dry_run)


def test_report_schema_and_an_item_that_raises_fails_loudly(tmp_path):
    items = (item("fine"), item("raising", prepare=boom), item("short", measure=lambda c, p, d: ("missed", {}, "low")),
             item("not_asked"))
    args = gc.parse_args([])
    args.skip = ["not_asked"]
    context = ctx(tmp_path)
    rows = gc.run_all(items, context, args, echo=lambda *a, **k: None)
    report = gc.make_report(rows, context, 0.0, 12.5)
    assert report["schema"] == gc.SCHEMA and report["exit_code"] == gc.EXIT_ERROR
    assert set(report) >= {"started", "finished", "duration_s", "budget_s", "dry_run", "device", "torch", "code",
                           "items"}
    by_name = {r["name"]: r for r in report["items"]}
    for row in by_name.values():
        assert set(row) >= {"name", "status", "duration_s", "budget_s", "measurements", "goal", "verdict", "reason"}
        assert row["status"] in gc.STATUSES
    assert by_name["fine"]["status"] == "passed" and by_name["fine"]["measurements"]["value"] == 1
    assert by_name["raising"]["status"] == "error"
    assert "prepare failed: ValueError: boom in prepare" in by_name["raising"]["verdict"]
    assert by_name["short"]["status"] == "missed"
    assert by_name["not_asked"]["status"] == "skipped" and by_name["not_asked"]["reason"] == "--skip on the command line"
    text = gc.table(report)
    assert "FAILED: raising" in text and "goal missed: short" in text and "--skip on the command line" in text
    written = gc.write_report(report, str(tmp_path / "report.json"))
    assert json.loads(written.read_text()) == json.loads(json.dumps(report))
    with pytest.raises(UserError, match="-o"):
        gc.write_report(report, str(tmp_path))  # a directory


def test_a_nan_measurement_does_not_cost_the_report(tmp_path):
    nan = item("nan", measure=lambda c, p, d: ("missed", {"loss": [1.0, float("nan")], "mfu": float("inf")}, "x"))
    context = ctx(tmp_path)
    report = gc.make_report(gc.run_all((nan,), context, gc.parse_args([]), echo=lambda *a, **k: None), context, 0, 1)
    written = json.loads(gc.write_report(report, str(tmp_path / "r.json")).read_text())
    assert written["items"][0]["measurements"]["loss"] == [1.0, "nan"]
    assert written["items"][0]["measurements"]["mfu"] == "inf"


def test_a_partly_failed_item_is_an_error_that_keeps_what_it_measured(tmp_path):
    def half(ctx, prepared, deadline):
        raise gi.PartialFailure("z3_ckpt_mb2: exit 1", {"rows": [{"name": "z2_mb1", "ratio": 1.02}]})
    row = gc.run_item(item("memory", measure=half), ctx(tmp_path), None)
    assert row["status"] == "error" and "z3_ckpt_mb2: exit 1" in row["verdict"]
    assert row["measurements"]["rows"] == [{"name": "z2_mb1", "ratio": 1.02}] and row["measurements"]["prepared"]


def test_exit_codes_missed_only_and_all_passed(tmp_path):
    args = gc.parse_args([])
    missed = gc.run_all((item("a"), item("b", measure=lambda c, p, d: ("missed", {}, "low"))), ctx(tmp_path), args,
                        echo=lambda *a, **k: None)
    assert gc.exit_code(missed) == gc.EXIT_MISSED
    assert gc.exit_code(gc.run_all((item("a"),), ctx(tmp_path), args, echo=lambda *a, **k: None)) == gc.EXIT_OK
    bad = gc.run_all((item("odd", measure=lambda c, p, d: ("great", {}, "")),), ctx(tmp_path), args,
                     echo=lambda *a, **k: None)
    assert bad[0]["status"] == "error" and "unknown status 'great'" in bad[0]["verdict"]


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

def test_item_budgets_fit_the_eight_minutes():
    assert gc.budget_check() <= gc.TOTAL_BUDGET_S == 480
    assert [i.name for i in gc.ITEMS] == ["preflight", "throughput", "memory", "kernels", "fp16", "zeropp",
                                          "inference", "gpu_tests"]
    with pytest.raises(AssertionError, match="over the 480 s budget"):
        gc.budget_check(gc.ITEMS + (item("extra", budget=100),))


def test_an_item_past_its_budget_is_an_error_and_its_time_is_reported(tmp_path):
    ticks = iter([100.0, 112.0])  # started, finished: 12 s on a 5 s budget
    row = gc.run_item(item("slow", budget=5), ctx(tmp_path), None, clock=lambda: next(ticks))
    assert row["status"] == "error" and row["duration_s"] == 12.0
    assert "took 12 s, over its 5 s budget (was: fine)" in row["verdict"]
    deadline_seen = []
    gc.run_item(item("d", measure=lambda c, p, d: deadline_seen.append(d) or ("passed", {}, "")), ctx(tmp_path),
                None, clock=iter([7.0, 8.0]).__next__)
    assert deadline_seen == [12.0]  # start + budget: what subprocess timeouts count down to


# ============================================================================================ plan rows

@pytest.fixture(scope="module")
def dry_ctx(tmp_path_factory):
    return gc.Context(tmp_path_factory.mktemp("gpu_check"), dry_run=True)


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


def test_throughput_plan_uses_the_1b_shape_and_a_micro_batch_that_fits(dry_ctx):
    prepared = gi.prepare_throughput(dry_ctx)
    assert prepared["num_params"] == mem.count_params(load_preset(gi.PRESET).model) == 1_235_814_400
    assert prepared["gpu"] == "h200" and prepared["micro_batch"] == 4 and prepared["seq_len"] == 4096
    assert prepared["planned_gpu_bytes"] < 139.8 * 2**30 * 0.9
    assert set(prepared["variants"]) == {"sdpa", "flash", "flash_liger"}
    assert prepared["variants"]["flash_liger"]["contenders"] == ["minimal", "trainer", "hf_trainer"]
    for name, variant in prepared["variants"].items():
        cmd = variant["command"]
        assert cmd[cmd.index("--steps") + 1] == "35" and cmd[cmd.index("--warmup") + 1] == "5"
        assert f"model.attn_implementation={variant['attention']}" in cmd
        assert variant["resolved"]["precision"] == "bf16" and variant["resolved"]["world_size"] == 1


def test_fp16_item_takes_the_v100_presets_loss_scaling_block(dry_ctx):
    cmd = gi.prepare_fp16(dry_ctx)["command"]
    value = next(c for c in cmd if c.startswith("deepspeed.fp16="))
    block = yaml.safe_load(value.split("=", 1)[1])
    assert block == load_preset("7b_2xv100").deepspeed["fp16"]
    assert block["loss_scale"] == 0  # 0 = dynamic loss scaling


def test_zeropp_is_skipped_with_its_reason_on_one_gpu(tmp_path):
    one = gc.Context(tmp_path, dry_run=False, device_name="NVIDIA H200", gpu_count=1)
    status, _, why = gi.measure_zeropp(one, gi.prepare_zeropp(one), 1e12)
    assert status == "skipped" and "one GPU" in why


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels item itself runs this worker")
def test_the_kernels_worker_on_cpu_sees_no_flash_or_liger_and_the_item_says_so(dry_ctx):
    """The worker's real plumbing (build_model, profiler, classification) on a shrunk model: on CPU flash-attn and
    Liger fall back to sdpa and torch, which is exactly what the checks must catch (a silent fallback)."""
    spec = gi.prepare_kernels(dry_ctx)
    for run in spec["runs"]:
        run["overrides"] = with_overrides(run["overrides"], SHRUNK)  # the shrunk values replace the item's
    found = gi.kernels_worker(spec)
    assert found["flash_liger"]["attention"] == "sdpa" and found["flash_liger"]["kernel_count"] > 10
    assert found["flash_liger"]["flash_attn_kernels"] == found["flash_liger"]["liger_kernels"] == []
    checks = gi.kernel_checks(found)
    assert not checks["attention is flash_attention_2"] and not checks["flash_attn kernels ran"]
    assert not checks["Liger kernels ran"] and checks["the sdpa run had neither"]


def test_pytest_summary_counts():
    out = "....s\nSKIPPED [1] tests/test_gpu.py:27: flash-attn is not installed\n4 passed, 1 skipped in 61.2s\n"
    assert gi.pytest_counts(out) == {"passed": 4, "failed": 0, "skipped": 1, "error": 0}
    assert gi.pytest_counts("1 failed, 2 passed, 1 error in 3s") == {"passed": 2, "failed": 1, "skipped": 0,
                                                                     "error": 1}


def test_the_trainers_kernels_line_is_read_from_a_launch_log(tmp_path):
    from trainer.model import build_model, kernels_in_use
    cfg = resolve(load_preset("tiny_cpu", ["hardware.gpus_per_node=1"]), 1).config
    model, _ = build_model(cfg, 0)
    log = tmp_path / "trainer_0.log"
    log.write_text(f"noise\n[rank0]: model: 3,000 parameters (3,000 trainable); {kernels_in_use(model)}\nmore\n")
    assert gi.kernels_line(log) == "attention sdpa, liger off"


# ============================================================================================ end to end

@pytest.mark.slow
def test_cpu_dry_run_end_to_end(tmp_path):
    report_path = tmp_path / "report.json"
    proc = run_script("--cpu-dry-run", "-o", str(report_path), "--workdir", str(tmp_path / "work"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["dry_run"] is True and report["exit_code"] == 0
    assert [r["name"] for r in report["items"]] == [i.name for i in gc.ITEMS]
    for row in report["items"]:
        assert row["status"] == "skipped" and row["reason"].startswith("--cpu-dry-run"), row
        assert row["measurements"]["prepared"], row["name"]
        assert f"\n{row['name']:<11} skipped" in proc.stdout  # its line in the table
    throughput = report["items"][1]["measurements"]["prepared"]
    assert throughput["synthetic_batch"]["input_ids"]["shape"] == [4, gi.DRY_SEQ_LEN]
    assert "cpu dry run: nothing measured" in proc.stdout
