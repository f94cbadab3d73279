"""The items of scripts/gpu_check.py: each a `prepare_*` (CPU-checkable: synthetic corpus, planner rows, command
lines) and a `measure_*` (GPU), plus the workers the measurements start (`gpu_check.py --worker NAME`).

Synthetic tokens: a deterministic corpus of words (seeded) tokenized through the trainer's own data path
(prepare into `<workdir>/cache`, `build_datasets`, `MicroBatchLoader`) with the shipped tiny tokenizer, so
nothing is downloaded; the model keeps its real vocabulary (1b_pretrain_8xh100: 128,256), which is what sets
the logits' memory and FLOPs. Token ids then cover only the tokenizer's range, which no kernel cares about.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
TINY_TOKENIZER = REPO / "data" / "tiny" / "tokenizer"
PRESET = "1b_pretrain_8xh100"
SEQ_LEN, DRY_SEQ_LEN = 4096, 128
STEPS, WARMUP = 35, 5                     # 30 timed steps after warm-up
MEMORY_LAYERS = 4                         # the 1B shape with 4 of its 16 layers: quicker to build, same per-layer terms
GOALS = {"mfu_flash_liger": 0.50, "vs_minimal": 0.99, "vs_hf_trainer": 1.05, "memory_ratio": 0.10,
         "generate_vs_transformers": 0.95}
VARIANTS = {  # name -> (attention, liger, contenders): the goals' ratios come from the flash + Liger round
    "flash_liger": ("flash_attention_2", True, "minimal,trainer,hf_trainer"),
    "flash": ("flash_attention_2", False, "trainer"),
    "sdpa": ("sdpa", False, "trainer"),
}
# ZeRO-2 and -3, checkpointing off/on, micro-batches 1 and 2, Liger off/on. Liger stays on ZeRO-2: its fused loss
# reads lm_head.weight without calling lm_head, which ZeRO-3 gathers only for a module's own forward.
MEMORY_ROWS = (
    {"name": "z2_mb1", "stage": 2, "checkpointing": False, "micro_batch": 1, "liger": False},
    {"name": "z2_ckpt_mb2_liger", "stage": 2, "checkpointing": True, "micro_batch": 2, "liger": True},
    {"name": "z3_ckpt_mb2", "stage": 3, "checkpointing": True, "micro_batch": 2, "liger": False},
    {"name": "z3_mb1", "stage": 3, "checkpointing": False, "micro_batch": 1, "liger": False},
)
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "park", "with", "Tom", "Emma", "saw",
         "frog", "said", "big", "little", "red", "tree", "sun", "went", "school", "they", "is", "2", "plus", "3")
LIGER_KERNEL_MARKERS = ("rms_norm", "swiglu", "rope", "cross_entropy", "element_mul")


class PartialFailure(RuntimeError):
    """A measurement that failed in part: the item is an error, and what was measured still goes in the report."""

    def __init__(self, message: str, measurements: dict):
        super().__init__(message)
        self.measurements = measurements


def code_version() -> str:
    import bench
    return bench.code_version()


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}


def gpu_row(ctx) -> str:
    """The trainer.hardware row of the GPU present; h200 (the lent machine) in a dry run."""
    from trainer.hardware import GPUS, gpu_of_device
    found = gpu_of_device(ctx.device_name)
    if found:
        return found.name
    if ctx.dry_run:
        return "h200"
    raise RuntimeError(f"device {ctx.device_name!r} has no row in trainer/hardware.py GPUS ({', '.join(GPUS)})")


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 1:
        raise RuntimeError("no time left in this item's budget")
    return left


def run_logged(cmd: list[str], log: Path, deadline: float, what: str) -> None:
    """A subprocess in its own process group, killed at the item's deadline; a failure raises with the log's tail."""
    import bench
    rc = bench.launch(cmd, env(), log, int(remaining(deadline)))
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{what}: {'ran past the budget' if rc == 'timeout' else f'exit {rc}'}; log {log}:\n{tail}")


def worker_command(name: str, spec: dict, ctx, tag: str) -> tuple[list[str], Path, Path]:
    spec_path, out = ctx.workdir / f"{tag}.spec.json", ctx.workdir / f"{tag}.out.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    cmd = [sys.executable, str(SCRIPTS / "gpu_check.py"), "--worker", name, "--spec", str(spec_path), "--out", str(out)]
    return cmd, out, ctx.workdir / f"{tag}.log"


def run_worker_item(name: str, spec: dict, ctx, tag: str, deadline: float) -> dict:
    cmd, out, log = worker_command(name, spec, ctx, tag)
    out.unlink(missing_ok=True)
    run_logged(cmd, log, deadline, f"worker {tag}")
    return json.loads(out.read_text())


# ============================================================================================ synthetic data

def write_synthetic_corpus(path: Path, sequences: int, seq_len: int, seed: int = 0) -> Path:
    """A jsonl of word salad, the same bytes for the same arguments: >= sequences x seq_len tokens (each word is
    at least one token), in documents of about one sequence each."""
    rng = random.Random(seed)
    with open(path, "w") as out:
        for _ in range(sequences + 1):
            out.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(seq_len))}) + "\n")
    return path


def synthetic_overrides(ctx, corpus: Path, seq_len: int) -> list[str]:
    return [f"data.source={corpus}", "data.subset=null", f"model.tokenizer={TINY_TOKENIZER}",
            f"data.cache_dir={ctx.workdir / 'cache'}", "data.eval_fraction=0.05", "data.num_workers=1",
            f"data.seq_len={seq_len}"]


def synthetic_batch(overrides: list[str], preset: str = PRESET) -> dict:
    """The first micro-batch through the trainer's data path, described (shapes, dtypes, a checksum)."""
    from trainer.data import MicroBatchLoader, apply_chat_template, build_datasets, load_tokenizer
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    cfg = resolve(load_preset(preset, overrides), 1).config
    tokenizer = apply_chat_template(load_tokenizer(cfg.model), cfg.data)
    data = build_datasets(cfg.data, tokenizer, cfg.train.seed)
    batch = next(iter(MicroBatchLoader(data.train, cfg.train.micro_batch_size, 0, 1, 1)))
    return {key: {"shape": list(t.shape), "dtype": str(t.dtype), "sum": int(t.sum()), "max": int(t.max())}
            for key, t in batch.items()} | {"train_sequences": len(data.train)}


def base_overrides(ctx, micro_batch: int) -> list[str]:
    return [f"hardware.gpu={gpu_row(ctx)}", "hardware.gpus_per_node=1", "hardware.nodes=1",
            f"train.micro_batch_size={micro_batch}", "train.grad_accum=1", "train.warmup_steps=2",
            "logging.log_every=5"]


def check_resolves(preset: str, overrides: list[str], ranks: int) -> dict:
    """The configuration a launch will get, resolved here first: a bad key fails in the prepare step, on CPU."""
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    return resolve(load_preset(preset, overrides), ranks).summary()


def flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


# ============================================================================================ preflight

PACKAGES = ("torch", "deepspeed", "transformers", "flash_attn", "liger_kernel", "accelerate")


def prepare_preflight(ctx) -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"versions": versions, "nvcc": shutil.which("nvcc"), "python": sys.version.split()[0]}


def measure_preflight(ctx, prepared, deadline):
    import torch
    props = torch.cuda.get_device_properties(0)
    found = {"device": ctx.device_name, "gpus": ctx.gpu_count, "capability": f"{props.major}.{props.minor}",
             "total_memory_gib": round(props.total_memory / 2**30, 1), "gpu_row": gpu_row(ctx)}
    missing = [n for n in ("flash_attn", "liger_kernel") if not prepared["versions"][n]]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not installed: pip install -e '.[gpu,test]'")
    started = time.monotonic()
    from deepspeed.ops.op_builder import FusedAdamBuilder
    FusedAdamBuilder().load()  # every training item's optimizer: a first JIT build takes a minute, once
    found["fused_adam_load_s"] = round(time.monotonic() - started, 1)
    return "passed", found, f"{ctx.device_name} x{ctx.gpu_count}, flash-attn {prepared['versions']['flash_attn']}, " \
                            f"liger-kernel {prepared['versions']['liger_kernel']}"


# ============================================================================================ throughput

def choose_micro_batch(ctx, seq_len: int) -> tuple[int, float]:
    """The largest micro-batch (4, 2, 1) the planner fits on this GPU for the heaviest variant (sdpa, no Liger)."""
    from trainer.plan.estimate import plan_for_resolved
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    for micro in (4, 2, 1):
        resolved = resolve(load_preset(PRESET, base_overrides(ctx, micro) + [f"data.seq_len={seq_len}"]), 1)
        estimate = plan_for_resolved(resolved, attention="sdpa")
        if estimate.fits_gpu:
            return micro, estimate.gpu_total
    raise RuntimeError(f"the planner fits no micro-batch of {PRESET} at seq {seq_len} on one {gpu_row(ctx)}")


def prepare_throughput(ctx) -> dict:
    from trainer.plan import memory as mem
    from trainer.presets import load_preset
    from trainer.train.metrics import flops_per_token
    seq = DRY_SEQ_LEN if ctx.dry_run else SEQ_LEN
    micro, planned = choose_micro_batch(ctx, SEQ_LEN)
    corpus = write_synthetic_corpus(ctx.workdir / "synthetic.jsonl", 4 if ctx.dry_run else 64, seq)
    common = base_overrides(ctx, micro) + synthetic_overrides(ctx, corpus, seq)
    batch = synthetic_batch(common)  # prepares the corpus once, into the cache every launch reuses
    model = load_preset(PRESET, common).model
    params = mem.count_params(model)
    variants = {}
    for name, (attention, liger, contenders) in VARIANTS.items():
        overrides = common + [f"model.attn_implementation={attention}", f"model.liger={str(liger).lower()}"]
        cmd = [sys.executable, str(SCRIPTS / "bench.py"), "--preset", PRESET, "--steps", str(STEPS), "--warmup",
               str(WARMUP), "--repeats", "1", "--ranks", "1", "--contenders", contenders,
               "--workdir", str(ctx.workdir / f"bench_{name}")]
        for item in overrides:
            cmd += ["--set", item]
        variants[name] = {"attention": attention, "liger": liger, "contenders": contenders.split(","), "command": cmd,
                          "resolved": check_resolves(PRESET, overrides, 1)}
    return {"gpu": gpu_row(ctx), "micro_batch": micro, "planned_gpu_bytes": planned, "seq_len": SEQ_LEN,
            "tokens_per_step": micro * SEQ_LEN, "num_params": params, "steps": STEPS, "warmup": WARMUP,
            "flops_per_token": flops_per_token(params, model.num_layers, model.hidden_size, SEQ_LEN),
            "synthetic_batch": batch, "variants": variants}


def kernels_line(log: Path) -> str:
    """The trainer's start-up line 'model: N parameters (...); attention X, liger Y' from a launch log."""
    found = re.search(r"; (attention \S+, liger .*)$", log.read_text(errors="replace"), re.M)
    return found.group(1) if found else ""


def measure_throughput(ctx, prepared, deadline):
    from trainer.hardware import gpu
    peak = gpu(prepared["gpu"]).peak_tflops * 1e12
    results, failures = {}, []
    for name, variant in prepared["variants"].items():  # one variant failing leaves the others' numbers
        try:
            results.update(run_variant(ctx, name, variant, prepared["flops_per_token"] / peak, deadline))
        except Exception as err:
            failures.append(f"{name}: {err}")
    if failures:
        raise PartialFailure("; ".join(failures), {"runs": results})
    ours = results["flash_liger/trainer"]["tokens_per_s"]
    ratios = {"mfu_flash_liger": results["flash_liger/trainer"]["mfu"],
              "vs_minimal": ours / results["flash_liger/minimal"]["tokens_per_s"],
              "vs_hf_trainer": ours / results["flash_liger/hf_trainer"]["tokens_per_s"]}
    met = {key: value >= GOALS[key] for key, value in ratios.items()}
    verdict = ", ".join(f"{k} {v:.3f} ({'ok' if met[k] else 'MISSED'}, goal {GOALS[k]})" for k, v in ratios.items())
    return ("passed" if all(met.values()) else "missed"), {"runs": results, "ratios": ratios}, verdict


def run_variant(ctx, name: str, variant: dict, mfu_per_token_s: float, deadline: float) -> dict:
    """One bench.py launch round; its contenders' tokens/s and MFU, and the kernels the trainer said it ran."""
    import bench
    cmd = [*variant["command"], "--port", str(ctx.next_port()), "--timeout", str(int(remaining(deadline)))]
    run_logged(cmd, ctx.workdir / f"bench_{name}.log", deadline, f"bench {name}")
    workdir = Path(variant["command"][variant["command"].index("--workdir") + 1])
    results = {}
    for contender in variant["contenders"]:
        summary = bench.summarize(json.loads((workdir / f"{contender}_0.json").read_text()), WARMUP, STEPS)
        results[f"{name}/{contender}"] = {"tokens_per_s": summary["tokens_per_s"],
                                          "mfu": summary["tokens_per_s"] * mfu_per_token_s,
                                          "median_step_s": summary["median_step_s"]}
    ran = kernels_line(workdir / "trainer_0.log")
    results[f"{name}/trainer"]["kernels"] = ran
    if f"attention {variant['attention']}" not in ran or (variant["liger"] == ("liger off" in ran)):
        raise PartialFailure(f"ran with '{ran or 'no kernels line'}': a silent fallback", results)
    return results


# ============================================================================================ memory

def memory_overrides(ctx, row: dict) -> list[str]:
    from trainer.ds import set_override
    attention = "flash_attention_2" if flash_available() or ctx.dry_run else "sdpa"
    return base_overrides(ctx, row["micro_batch"]) + [
        f"model.num_layers={MEMORY_LAYERS}", set_override("zero_optimization.stage", row["stage"]),
        f"model.gradient_checkpointing={str(row['checkpointing']).lower()}", f"model.liger={str(row['liger']).lower()}",
        f"model.attn_implementation={attention}", f"model.tokenizer={TINY_TOKENIZER}", "train.precision=bf16"]


def plan_row(overrides: list[str]) -> dict:
    """The planner's per-GPU bytes for one configuration (its attention kernel as configured)."""
    from trainer.plan.estimate import plan_for_resolved
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    resolved = resolve(load_preset(PRESET, overrides), 1)
    estimate = plan_for_resolved(resolved, attention=resolved.config.model.attn_implementation)
    return {**estimate.gpu_bytes(), "logits": estimate.activations.logits}


def prepare_memory(ctx) -> dict:
    rows = []
    for row in MEMORY_ROWS:
        overrides = memory_overrides(ctx, row)
        rows.append({**row, "overrides": overrides, "planned": plan_row(overrides)})
    return {"seq_len": SEQ_LEN, "layers": MEMORY_LAYERS, "rows": rows}


def measure_memory(ctx, prepared, deadline):
    rows, worst, failures = [], 0.0, []
    for row in prepared["rows"]:  # one configuration failing (an OOM, say) leaves the others' numbers
        try:
            measured = run_worker_item("memory", {"overrides": row["overrides"]}, ctx, f"memory_{row['name']}",
                                       deadline)
        except Exception as err:
            failures.append(f"{row['name']}: {err}")
            continue
        attention = next(o.split("=", 1)[1] for o in row["overrides"] if o.startswith("model.attn_implementation="))
        if f"attention {attention}" not in measured["kernels"] or row["liger"] == ("liger off" in measured["kernels"]):
            failures.append(f"{row['name']}: ran with '{measured['kernels']}', not what the planner priced")
        ratio = measured["peak_bytes"] / row["planned"]["total"]
        worst = max(worst, abs(ratio - 1))
        rows.append({"name": row["name"], "measured_bytes": measured["peak_bytes"],
                     "planned_bytes": row["planned"]["total"], "ratio": ratio, **measured})
    if failures:
        raise PartialFailure("; ".join(failures), {"rows": rows})
    verdict = "; ".join(f"{r['name']} {r['ratio']:.3f}" for r in rows) + f" (goal within {GOALS['memory_ratio']:.0%})"
    return ("passed" if worst <= GOALS["memory_ratio"] else "missed"), {"rows": rows}, verdict


def memory_worker(spec: dict) -> dict:
    """deepspeed.initialize on the configuration, three steps on random tokens, the CUDA peak."""
    import deepspeed
    import torch
    from measure_memory import random_batch

    from trainer.distributed import start_distributed
    from trainer.model import build_model, kernels_in_use
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    rank = start_distributed()
    resolved = resolve(load_preset(PRESET, spec["overrides"]), 1)
    torch.manual_seed(0)
    model, hf_ds_config = build_model(resolved.config, rank)
    kernels = kernels_in_use(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=resolved.ds)
    cuda = torch.cuda.is_available()  # CPU: the same steps, for a check of the worker itself (peak RSS instead)
    after_init = torch.cuda.memory_allocated() if cuda else None
    losses = []
    for _ in range(3):
        loss = engine(**random_batch(resolved.config, engine.device)).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    if cuda:
        torch.cuda.synchronize()
    del hf_ds_config
    from trainer.train.metrics import peak_memory_gb
    return {"peak_bytes": torch.cuda.max_memory_allocated() if cuda else int(peak_memory_gb() * 1e9),
            "peak_is": "torch.cuda.max_memory_allocated" if cuda else "peak RSS (CPU)",
            "after_init_bytes": after_init, "kernels": kernels, "losses": losses,
            "zero_stage": resolved.summary()["zero_stage"]}


# ============================================================================================ kernels

def kernel_overrides(ctx, liger: bool, attention: str) -> list[str]:
    return base_overrides(ctx, 1) + [
        "model.num_layers=2", f"model.attn_implementation={attention}", f"model.liger={str(liger).lower()}",
        f"model.tokenizer={TINY_TOKENIZER}", "train.precision=bf16", "data.seq_len=1024"]


def prepare_kernels(ctx) -> dict:
    # sdpa first: Liger patches transformers' classes for the whole process, so it must come last.
    return {"runs": [{"name": "sdpa", "overrides": kernel_overrides(ctx, False, "sdpa")},
                     {"name": "flash_liger", "overrides": kernel_overrides(ctx, True, "flash_attention_2")}],
            "liger_markers": LIGER_KERNEL_MARKERS}


NOT_A_PACKAGE_KERNEL = ("aten::", "autograd::", "at::", "pytorch_flash", "cudnn", "Backward")


def flash_attn_kernels(names: list[str]) -> list[str]:
    """Device kernels of the flash_attn package (flash_fwd_kernel<...>, flash::...), not those sdpa itself runs:
    PyTorch's copy (pytorch_flash::) and cuDNN's (cudnn_..._flash_...), nor the ops' CPU-side names (aten::)."""
    return sorted({n for n in names if "flash" in n.lower() and not any(x in n for x in NOT_A_PACKAGE_KERNEL)})


def liger_kernels(names: list[str]) -> list[str]:
    """Triton kernels of Liger (plain names such as _rms_norm_forward_kernel), not ATen's (void at::...)."""
    return sorted({n for n in names if not n.startswith("void ") and not any(x in n for x in NOT_A_PACKAGE_KERNEL)
                   and any(m in n.lower() for m in LIGER_KERNEL_MARKERS)})


def measure_kernels(ctx, prepared, deadline):
    found = run_worker_item("kernels", prepared, ctx, "kernels", deadline)
    checks = kernel_checks(found)
    failed = [k for k, ok in checks.items() if not ok]
    verdict = "all seen" if not failed else "NOT seen: " + "; ".join(failed)
    return ("passed" if not failed else "missed"), {"runs": found, "checks": checks}, verdict


def kernel_checks(found: dict) -> dict[str, bool]:
    """What must have executed in the flash + Liger run, and not in the sdpa run (so the markers mean something)."""
    flash, plain = found["flash_liger"], found["sdpa"]
    return {"attention is flash_attention_2": flash["attention"] == "flash_attention_2",
            "flash_attn kernels ran": bool(flash["flash_attn_kernels"]),
            "Liger modules in the model": bool(flash["liger_modules"]),
            "Liger kernels ran": bool(flash["liger_kernels"]),
            "the sdpa run had neither": not plain["flash_attn_kernels"] and not plain["liger_kernels"]}


def kernels_worker(spec: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainer.model import build_model
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    cuda = torch.cuda.is_available()  # CPU: the same plumbing, for a check of the worker itself (no kernels)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {}
    for run in spec["runs"]:
        cfg = resolve(load_preset(PRESET, run["overrides"]), 1).config
        model, _ = build_model(cfg, 0)
        model = model.to(device, dtype).train()
        ids = torch.randint(0, 1000, (1, cfg.data.seq_len), device=device)
        model(input_ids=ids, labels=ids).loss.backward()  # warm-up: Triton compiles outside the trace
        with profile(activities=activities) as prof:
            model(input_ids=ids, labels=ids).loss.backward()
            if cuda:
                torch.cuda.synchronize()
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        names = [e.key for e in prof.key_averages() if e.device_type == kind]  # what ran on the device
        out[run["name"]] = {"attention": model.config._attn_implementation,
                            "liger_modules": sorted({type(m).__name__ for m in model.modules()
                                                     if type(m).__name__.startswith("Liger")}),
                            "flash_attn_kernels": flash_attn_kernels(names), "liger_kernels": liger_kernels(names),
                            "kernel_count": len(names)}
        del model
        if cuda:
            torch.cuda.empty_cache()
    return out


# ============================================================================================ fp16 and ZeRO++

def tiny_train_command(ctx, name: str, ranks: int, extra: list[str]) -> tuple[list[str], Path]:
    """train.py on tiny_cpu's model and shipped corpus, on the GPU(s)."""
    out = ctx.workdir / name
    overrides = [f"hardware.gpu={gpu_row(ctx)}", f"hardware.gpus_per_node={ranks}", "hardware.nodes=1",
                 "train.max_steps=20", "train.eval_every=0", "train.save_every=0", "train.export_hf=false",
                 "logging.log_every=1", "logging.wandb_mode=disabled", "logging.progress_bar=false",
                 f"train.output_dir={out}", *extra]
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port", "PORT",
           str(REPO / "train.py"), "--preset", "tiny_cpu"]
    for item in overrides:
        cmd += ["--set", item]
    check_resolves("tiny_cpu", overrides, ranks)
    return cmd, out


def fp16_block() -> str:
    """7b_2xv100's fp16 block (dynamic loss scaling), as a --set value."""
    import yaml

    from trainer.files import read_yaml_mapping
    block = read_yaml_mapping(REPO / "presets" / "7b_2xv100.yaml", "preset 7b_2xv100")["deepspeed"]["fp16"]
    return "deepspeed.fp16=" + yaml.safe_dump(block, default_flow_style=True, width=10_000).strip()


def prepare_fp16(ctx) -> dict:
    from trainer.ds import set_override
    cmd, out = tiny_train_command(ctx, "fp16", 1, ["train.precision=fp16", fp16_block(),
                                                   set_override("zero_optimization.stage", 3)])
    return {"command": cmd, "run_dir": str(out)}


def train_rows(ctx, prepared, deadline, tag: str) -> list[dict]:
    cmd = [str(ctx.next_port()) if part == "PORT" else part for part in prepared["command"]]
    run_logged(cmd, ctx.workdir / f"{tag}.log", deadline, f"train {tag}")
    rows = [json.loads(line) for line in (Path(prepared["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def measure_fp16(ctx, prepared, deadline):
    rows = train_rows(ctx, prepared, deadline, "fp16")
    scales = [r.get("loss_scale") for r in rows]
    ok = bool(rows) and all(s is not None and s >= 1 for s in scales) and rows[-1]["loss"] < rows[0]["loss"]
    found = {"loss_scale": scales, "first_loss": rows[0]["loss"] if rows else None,
             "last_loss": rows[-1]["loss"] if rows else None, "steps_logged": len(rows)}
    verdict = (f"loss scale {scales[0]} -> {scales[-1]}, loss {found['first_loss']:.3f} -> {found['last_loss']:.3f}"
               if rows else "no step was logged")
    return ("passed" if ok else "missed"), found, verdict


def prepare_zeropp(ctx) -> dict:
    from trainer.ds import set_override
    ranks = max(ctx.gpu_count, 2) if ctx.dry_run else ctx.gpu_count
    zeropp = [set_override("zero_optimization.stage", 3),
              set_override("zero_optimization.zero_quantized_weights", True)]
    cmd, out = tiny_train_command(ctx, "zeropp", ranks, ["train.precision=bf16", *zeropp])
    return {"command": cmd, "run_dir": str(out), "ranks": ranks}


def measure_zeropp(ctx, prepared, deadline):
    if prepared["ranks"] < 2:
        return "skipped", {}, ("one GPU: ZeRO++ quantizes the weights ranks all-gather from each other, and one rank "
                               "gathers from nobody (tests/test_gpu.py still trains with it on one rank)")
    rows = train_rows(ctx, prepared, deadline, "zeropp")
    ok = bool(rows) and rows[-1]["loss"] < rows[0]["loss"]
    return ("passed" if ok else "missed"), {"losses": [r["loss"] for r in rows]}, \
        f"{prepared['ranks']} ranks, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}" if rows else "no steps"


# ============================================================================================ inference

def prepare_inference(ctx) -> dict:
    return {"model_dir": str(ctx.workdir / "generate_model"), "batch_sizes": [1, 8], "new_tokens": 64,
            "repeats": 2, "dtype": "fp16"}


def measure_inference(ctx, prepared, deadline):
    runs = {}
    for inject in (False, True):
        name = "inject" if inject else "plain"
        runs[name] = run_worker_item("inference", {**prepared, "kernel_inject": inject}, ctx, f"generate_{name}",
                                     deadline)
    worst = min(r["ratio"] for r in runs["plain"]["rows"])
    verdict = "; ".join(f"batch {p['batch']}: trainer {p['trainer']:.0f} tok/s, injected {i['trainer']:.0f}, "
                        f"transformers {p['transformers']:.0f}"
                        for p, i in zip(runs["plain"]["rows"], runs["inject"]["rows"]))
    return ("passed" if worst >= GOALS["generate_vs_transformers"] else "missed"), runs, verdict


def inference_worker(spec: dict) -> dict:
    import bench_generate
    model_dir = spec["model_dir"]
    if not Path(model_dir, "config.json").is_file():
        bench_generate.make_model(Path(model_dir))
    rows = [bench_generate.compare(model_dir, batch, spec["new_tokens"], spec["repeats"], spec["dtype"],
                                   spec["kernel_inject"]) for batch in spec["batch_sizes"]]
    return {"rows": rows}


# ============================================================================================ gpu tests

def prepare_gpu_tests(ctx) -> dict:
    return {"command": [sys.executable, "-m", "pytest", "-m", "gpu", str(REPO / "tests" / "test_gpu.py"), "-q",
                        "-rs", "-p", "no:cacheprovider"]}


def pytest_counts(output: str) -> dict:
    """{'passed': n, 'failed': n, 'skipped': n, 'error': n} from pytest's last summary line."""
    last = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed|skipped)", line)), "")
    counts = {key: 0 for key in ("passed", "failed", "skipped", "error")}
    for number, key in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last):
        counts["error" if key.startswith("error") else key] += int(number)
    return counts


def measure_gpu_tests(ctx, prepared, deadline):
    proc = subprocess.run(prepared["command"], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=remaining(deadline))
    counts = pytest_counts(proc.stdout)
    ok = proc.returncode == 0 and counts["passed"] > 0 and counts["skipped"] == 0
    skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    return ("passed" if ok else "missed"), {"counts": counts, "returncode": proc.returncode, "skips": skips,
                                            "tail": proc.stdout[-2000:]}, \
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, {counts['error']} errors"


# ============================================================================================ workers

WORKERS = {"memory": memory_worker, "kernels": kernels_worker, "inference": inference_worker}


def run_worker(name: str, spec_path: str, out: str) -> int:
    result = WORKERS[name](json.loads(Path(spec_path).read_text()))
    Path(out).write_text(json.dumps(result))
    return 0
