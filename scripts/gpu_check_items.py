"""The items of scripts/gpu_check.py: each a `prepare_*` (CPU-checkable: synthetic corpus, planner rows, command
lines) and a `measure_*` (GPU), plus the workers the measurements start (`gpu_check.py --worker NAME`).

Synthetic tokens: a deterministic corpus of words (seeded) tokenized through the trainer's own data path
(prepare into `<workdir>/cache`, `build_datasets`, `MicroBatchLoader`) with the shipped tiny tokenizer, so
nothing is downloaded; the model keeps its real vocabulary (1b_pretrain_8xh100: 128,256), which is what sets
the logits' memory and FLOPs. Token ids then cover only the tokenizer's range, which no kernel cares about.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
TINY_TOKENIZER = REPO / "data" / "tiny" / "tokenizer"
PRESET = "1b_pretrain_8xh100"
SEQ_LEN, DRY_SEQ_LEN = 4096, 128
STEPS, WARMUP = 20, 5                     # 15 timed steps after warm-up: on a GPU, steps of 16k tokens vary little
MEMORY_LAYERS = 4                         # the 1B shape with 4 of its 16 layers: quicker to build, same per-layer terms
GOALS = {"mfu_flash_liger": 0.50, "vs_minimal": 0.99, "vs_hf_trainer": 1.05, "memory_ratio": 0.10,
         "generate_vs_transformers": 0.95}
# Each unit of work an item plans, and its seconds on one H200 with 16 CPU cores: estimate = sum(count x seconds),
# budget = estimate x gpu_check.MARGIN. "measured": read off the GPU run of 2026-12-04 (docs/gpu-acceptance.md,
# its report's per-launch `timings`); the others are estimates nobody has measured yet.
UNIT_SECONDS = {
    "interpreter": 12.0,      # measured: a worker's Python (torch, transformers, DeepSpeed), CUDA and distributed init
    "launch": 32.0,           # measured: a one-rank `deepspeed` launch of a tiny model to its exit, steps aside
    "model_1b": 29.0,         # measured: building the 1.2B model and its engine; a smaller model by its parameters
    "tokens_1b_k": 0.03,      # not measured: 1,000 tokens of a 1.2B training step (~25% MFU)
    "step_tiny": 0.1,         # measured: one training step of tiny_cpu's model
    "triton_compile": 10.0,   # measured: Liger's Triton kernels compiled on their first call, once per process
    "generate_token": 0.02,   # not measured: one decode step of the bench model (batch up to 8), either contender
    "test": 3.0,              # not measured: one pytest start-up and collection
}
OP_BUILD_SECONDS = {"fused_adam": 39.0, "transformer_inference": 52.0}  # measured: nvcc 13.0, one arch, 16 cores
OP_BUILD_DEFAULT_S = 90.0     # an op this table does not name yet
# Throughput rounds: the goals' round is the first candidate whose kernels are installed (flash + Liger, else
# sdpa + Liger: the verdict then names the attention that ran), with every contender; plain sdpa is the baseline.
GOAL_CANDIDATES = (("flash_liger", "flash_attention_2", True), ("sdpa_liger", "sdpa", True))
BASELINE = ("sdpa", "sdpa", False)
ALL_CONTENDERS = "minimal,trainer,hf_trainer"
FLASH_MISSING = ("flash-attn is not installed as transformers needs it (trainer.model.flash_attention_available; "
                 "pip install flash-attn==2.8.3.post2 --no-build-isolation, docs/gpu-acceptance.md)")
LIGER_MISSING = "liger-kernel is not installed (pip install liger-kernel==0.8.5)"
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


def estimate_seconds(work: dict) -> float:
    """The seconds `work` ({unit: count}) takes on one H200 (UNIT_SECONDS; `op_build:NAME` from OP_BUILD_SECONDS)."""
    total = 0.0
    for unit, count in work.items():
        if unit.startswith("op_build:"):
            total += count * OP_BUILD_SECONDS.get(unit.split(":", 1)[1], OP_BUILD_DEFAULT_S)
        elif unit in UNIT_SECONDS:
            total += count * UNIT_SECONDS[unit]
        else:
            raise KeyError(f"work unit {unit!r} has no seconds in UNIT_SECONDS ({', '.join(UNIT_SECONDS)})")
    return total


def add_work(work: dict, **counts: float) -> dict:
    for unit, count in counts.items():
        work[unit] = round(work.get(unit, 0) + count, 3)
    return work


def plain(value):
    """`value` as plain JSON types (what crosses from an item's process and goes into the report)."""
    return json.loads(json.dumps(value, default=str))


def installed(module: str):
    """The installed version of the distribution that provides `module`, or None."""
    try:
        return importlib.metadata.version(module.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None


TIMINGS: list[dict] = []  # this item process's launches and workers with their wall times (the units' calibration)


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
    raise RuntimeError(f"device {ctx.device_name!r} has no entry in trainer/accelerators.yaml ({', '.join(GPUS)})")


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 1:
        raise RuntimeError("no time left in this item's budget")
    return left


def run_logged(cmd: list[str], log: Path, deadline: float, what: str, extra_env: dict | None = None) -> None:
    """A subprocess in its own session, stopped with all it started at the item's deadline; a failure raises with
    the log's tail. Its wall time goes to TIMINGS."""
    import bench
    started = time.monotonic()
    rc = bench.launch(cmd, {**env(), **(extra_env or {})}, log, int(remaining(deadline)))
    TIMINGS.append({"what": what, "seconds": round(time.monotonic() - started, 1), "rc": rc})
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


def launch_ops(preset: str, overrides: list[str], ranks: int) -> list[str]:
    """The DeepSpeed ops a launch of this configuration loads on CUDA ranks (trainer.ds.jit_ops)."""
    from trainer import ds as dsc
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    resolved = resolve(load_preset(preset, overrides), ranks)
    return dsc.jit_ops(resolved.ds, resolved.world_size, "cuda")


# ============================================================================================ preflight

PACKAGES = ("torch", "deepspeed", "transformers", "datasets", "tokenizers", "accelerate", "peft", "flash_attn",
            "liger_kernel", "triton")


def pinned_versions() -> dict[str, str]:
    """name -> version, from pyproject.toml's exact pins (dependencies and the gpu/test extras)."""
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values()
                                                    for r in extra]
    pins = {}
    for requirement in requirements:
        name, _, version = requirement.split(";")[0].partition("==")
        if version:
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def stack_versions() -> dict[str, dict]:
    """Each package the check runs on: the version found and the pinned one. A different installed stack (a GPU
    image's own torch, say) is reported, not refused: the numbers belong to the versions found."""
    pins = pinned_versions()
    return {name: {"found": installed(name), "pinned": pins.get(name.replace("_", "-"))} for name in PACKAGES}


def differs(versions: dict[str, dict]) -> list[str]:
    return [f"{name} {v['found'] or 'missing'} (pinned {v['pinned']})" for name, v in versions.items()
            if v["pinned"] and (v["found"] or "").split("+")[0] != v["pinned"]]


def prepare_preflight(ctx) -> dict:
    """Versions, and the op builds: every op the other planned items load (ctx.ops, filled by the plan)."""
    work = add_work({}, interpreter=1)
    for op in ctx.ops:
        add_work(work, **{f"op_build:{op}": 1})
    return {"versions": stack_versions(), "nvcc": shutil.which("nvcc"), "python": sys.version.split()[0],
            "ops": list(ctx.ops), "libaio": libaio_found(), "work": work}


def libaio_found() -> bool:
    """libaio's header, which DeepSpeed's async_io op (NVMe offload) compiles against."""
    return any(Path(d, "libaio.h").is_file() for d in ("/usr/include", "/usr/local/include"))


def measure_preflight(ctx, prepared, deadline):
    import torch
    props = torch.cuda.get_device_properties(0)
    found = {"device": ctx.device_name, "gpus": ctx.gpu_count, "capability": f"{props.major}.{props.minor}",
             "total_memory_gib": round(props.total_memory / 2**30, 1), "gpu_row": gpu_row(ctx),
             "torch_cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"), "flash_attention": ctx.flash,
             "liger": ctx.liger, "differs_from_pins": differs(prepared["versions"]), "ops": {}}
    if "async_io" in prepared["ops"] and not prepared["libaio"]:
        raise RuntimeError("an item loads DeepSpeed's async_io op and libaio's header is missing: "
                           "apt-get install libaio-dev (RHEL: yum install libaio-devel)")
    failed = []
    for op in prepared["ops"]:
        found["ops"][op] = build_op(op)
        if found["ops"][op]["error"]:
            failed.append(f"{op}: {found['ops'][op]['error']}")
    if failed:
        raise PartialFailure("op builds failed: " + "; ".join(failed), found)
    said = ", ".join(f"{op} {r['seconds']:.0f} s" for op, r in found["ops"].items()) or "no ops"
    missing = [n for n, ok in (("flash-attn", ctx.flash), ("liger-kernel", ctx.liger)) if not ok]
    return "passed", found, (f"{ctx.device_name} x{ctx.gpu_count}; built {said}"
                             + (f"; not installed: {', '.join(missing)} (their parts are skipped)" if missing else "")
                             + (f"; differs from the pins: {', '.join(found['differs_from_pins'])}"
                                if found["differs_from_pins"] else ""))


def build_op(op: str) -> dict:
    """One DeepSpeed op built (or loaded from the JIT cache) here, timed; a failure is named, not raised."""
    import build_ops
    from deepspeed.accelerator import get_accelerator
    started = time.monotonic()
    error = ""
    try:
        accelerator = get_accelerator()
        name = build_ops.builder_classes(accelerator).get(op)  # op name -> builder class, from DeepSpeed's own
        builder = accelerator.create_op_builder(name) if name else None
        if builder is None:
            raise RuntimeError(f"the {accelerator.device_name()} accelerator has no builder for {op}")
        builder.load()
    except Exception as err:  # the compiler's output is above, in the log
        error = f"{type(err).__name__}: {str(err)[-500:]}"
    seconds = round(time.monotonic() - started, 1)
    TIMINGS.append({"what": f"op {op}", "seconds": seconds, "rc": 1 if error else 0})
    return {"seconds": seconds, "error": error}


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


def missing_kernels(ctx, attention: str, liger: bool):
    """Why a run with this attention and Liger setting cannot run here (the skip reason), or None."""
    if attention == "flash_attention_2" and not ctx.flash:
        return FLASH_MISSING
    if liger and not ctx.liger:
        return LIGER_MISSING
    return None


def throughput_rounds(ctx) -> tuple[dict, dict]:
    """(rounds: name -> (attention, liger, contenders), skipped: name -> reason)."""
    rounds, skipped = {}, {}
    for name, attention, liger in GOAL_CANDIDATES:
        why = missing_kernels(ctx, attention, liger)
        if why or rounds:
            skipped[name] = why or f"{next(iter(rounds))} carries the goals"
        else:
            rounds[name] = (attention, liger, ALL_CONTENDERS)
    name, attention, liger = BASELINE
    goal_attention = next((a for n, a, _ in GOAL_CANDIDATES if n in rounds), None)
    if goal_attention == attention:  # sdpa + Liger carries the goals: a plain sdpa launch would add one minute
        skipped[name] = "the goals' round runs sdpa already (flash-attn not installed): no baseline to compare"
    else:
        rounds[name] = (attention, liger, "trainer" if rounds else ALL_CONTENDERS)
    return rounds, skipped


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
    rounds, skipped = throughput_rounds(ctx)
    variants, work, ops = {}, {}, []
    for name, (attention, liger, contenders) in rounds.items():
        overrides = common + [f"model.attn_implementation={attention}", f"model.liger={str(liger).lower()}"]
        cmd = [sys.executable, str(SCRIPTS / "bench.py"), "--preset", PRESET, "--steps", str(STEPS), "--warmup",
               str(WARMUP), "--repeats", "1", "--ranks", "1", "--contenders", contenders,
               "--workdir", str(ctx.workdir / f"bench_{name}")]
        for item in overrides:
            cmd += ["--set", item]
        variants[name] = {"attention": attention, "liger": liger, "contenders": contenders.split(","), "command": cmd,
                          "resolved": check_resolves(PRESET, overrides, 1)}
        launches = len(variants[name]["contenders"])  # the real sequence length, whatever the dry run prepared
        add_work(work, launch=launches, model_1b=launches, tokens_1b_k=launches * STEPS * micro * SEQ_LEN / 1000,
                 triton_compile=launches if liger else 0)
        ops += launch_ops(PRESET, overrides, 1)
    return {"gpu": gpu_row(ctx), "micro_batch": micro, "planned_gpu_bytes": planned, "seq_len": SEQ_LEN,
            "tokens_per_step": micro * SEQ_LEN, "num_params": params, "steps": STEPS, "warmup": WARMUP,
            "flops_per_token": flops_per_token(params, model.num_layers, model.hidden_size, SEQ_LEN),
            "synthetic_batch": batch, "variants": variants, "skipped": skipped, "work": work,
            "ops": list(dict.fromkeys(ops))}


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
    goal = next(n for n, v in prepared["variants"].items() if len(v["contenders"]) > 1)
    ours = results[f"{goal}/trainer"]["tokens_per_s"]
    ratios = {"mfu_flash_liger": results[f"{goal}/trainer"]["mfu"],
              "vs_minimal": ours / results[f"{goal}/minimal"]["tokens_per_s"],
              "vs_hf_trainer": ours / results[f"{goal}/hf_trainer"]["tokens_per_s"]}
    met = {key: value >= GOALS[key] for key, value in ratios.items()}
    verdict = f"{goal}: " + ", ".join(f"{k} {v:.3f} ({'ok' if met[k] else 'MISSED'}, goal {GOALS[k]})"
                                      for k, v in ratios.items())
    if goal != "flash_liger":
        verdict += f"; the MFU goal is flash-attn's, measured here with {prepared['variants'][goal]['attention']}"
    verdict += "".join(f"; {name} skipped: {why}" for name, why in prepared["skipped"].items())
    return ("passed" if all(met.values()) else "missed"), {"runs": results, "ratios": ratios, "goal_round": goal}, \
        verdict


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
    attention = "flash_attention_2" if ctx.flash else "sdpa"
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


def model_share(overrides: list[str]) -> float:
    """This configuration's model as a share of the 1B preset's, by parameters (what building it costs)."""
    from trainer.plan import memory as mem
    from trainer.presets import load_preset
    return round(mem.count_params(load_preset(PRESET, overrides).model) / mem.count_params(load_preset(PRESET).model), 3)


def prepare_memory(ctx) -> dict:
    rows, skipped, work, ops = [], {}, {}, []
    for row in MEMORY_ROWS:
        why = missing_kernels(ctx, "sdpa", row["liger"])
        if why:
            skipped[row["name"]] = why
            continue
        overrides = memory_overrides(ctx, row)
        rows.append({**row, "overrides": overrides, "planned": plan_row(overrides)})
        share = model_share(overrides)
        add_work(work, interpreter=1, model_1b=share, tokens_1b_k=3 * row["micro_batch"] * SEQ_LEN / 1000 * share,
                 triton_compile=1 if row["liger"] else 0)
        ops += launch_ops(PRESET, overrides, 1)
    return {"seq_len": SEQ_LEN, "layers": MEMORY_LAYERS, "rows": rows, "skipped": skipped, "work": work,
            "ops": list(dict.fromkeys(ops))}


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
    verdict += "".join(f"; {name} skipped: {why}" for name, why in prepared["skipped"].items())
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
    """A plain sdpa run, then one with the kernels installed here (flash-attn, Liger): what each executed."""
    attention = "flash_attention_2" if ctx.flash else "sdpa"
    skipped = {name: why for name, why in (("flash_attn", missing_kernels(ctx, "flash_attention_2", False)),
                                           ("liger", missing_kernels(ctx, "sdpa", True))) if why}
    # sdpa first: Liger patches transformers' classes for the whole process, so it must come last.
    runs = [{"name": "sdpa", "overrides": kernel_overrides(ctx, False, "sdpa")}]
    if len(skipped) < 2:
        runs.append({"name": "fast", "overrides": kernel_overrides(ctx, ctx.liger, attention)})
    work = add_work({}, interpreter=1, model_1b=sum(model_share(run["overrides"]) for run in runs),
                    triton_compile=1 if ctx.liger else 0)
    return {"runs": runs, "expects": {"flash": ctx.flash, "liger": ctx.liger}, "skipped": skipped,
            "liger_markers": LIGER_KERNEL_MARKERS, "work": work,
            "skip": "; ".join(skipped.values()) if len(runs) < 2 else ""}


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
    checks = kernel_checks(found, prepared["expects"])
    failed = [k for k, ok in checks.items() if not ok]
    verdict = ("all seen: " + ", ".join(checks)) if not failed else "NOT seen: " + "; ".join(failed)
    verdict += "".join(f"; {name} skipped: {why}" for name, why in prepared["skipped"].items())
    return ("passed" if not failed else "missed"), {"runs": found, "checks": checks}, verdict


def kernel_checks(found: dict, expects: dict) -> dict[str, bool]:
    """What must have executed in the run with the installed kernels (flash-attn, Liger, as `expects` says), and
    not in the sdpa run (so the markers mean something)."""
    fast, plain = found["fast"], found["sdpa"]
    checks = {"the sdpa run had neither": not plain["flash_attn_kernels"] and not plain["liger_kernels"]}
    if expects["flash"]:
        checks.update({"attention is flash_attention_2": fast["attention"] == "flash_attention_2",
                       "flash_attn kernels ran": bool(fast["flash_attn_kernels"])})
    if expects["liger"]:
        checks.update({"Liger modules in the model": bool(fast["liger_modules"]),
                       "Liger kernels ran": bool(fast["liger_kernels"])})
    return checks


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

TINY_STEPS = 20


def tiny_overrides(ctx, ranks: int) -> list[str]:
    return [f"hardware.gpu={gpu_row(ctx)}", f"hardware.gpus_per_node={ranks}", "hardware.nodes=1"]


def tiny_train_ops(ctx, ranks: int, extra: list[str]) -> list[str]:
    return launch_ops("tiny_cpu", tiny_overrides(ctx, ranks) + extra, ranks)


def tiny_train_command(ctx, name: str, ranks: int, extra: list[str]) -> tuple[list[str], Path]:
    """train.py on tiny_cpu's model and shipped corpus, on the GPU(s)."""
    out = ctx.workdir / name
    overrides = [*tiny_overrides(ctx, ranks),
                 f"train.max_steps={TINY_STEPS}", "train.eval_every=0", "train.save_every=0", "train.export_hf=false",
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
    extra = ["train.precision=fp16", fp16_block(), set_override("zero_optimization.stage", 3)]
    cmd, out = tiny_train_command(ctx, "fp16", 1, extra)
    return {"command": cmd, "run_dir": str(out), "work": add_work({}, launch=1, step_tiny=TINY_STEPS),
            "ops": tiny_train_ops(ctx, 1, extra)}


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
    prepared = {"command": cmd, "run_dir": str(out), "ranks": ranks}
    if ctx.gpu_count < 2:  # one GPU (the dry run plans for one H200): nothing to run, no process started
        return {**prepared, "skip": ZEROPP_ONE_GPU}
    return {**prepared, "work": add_work({}, launch=1, step_tiny=TINY_STEPS),
            "ops": tiny_train_ops(ctx, ranks, ["train.precision=bf16", *zeropp])}


ZEROPP_ONE_GPU = ("one GPU: ZeRO++ quantizes the weights ranks all-gather from each other, and one rank gathers "
                  "from nobody (tests/test_gpu.py still trains with it on one rank)")


def measure_zeropp(ctx, prepared, deadline):
    if prepared["ranks"] < 2:
        return "skipped", {}, ZEROPP_ONE_GPU
    rows = train_rows(ctx, prepared, deadline, "zeropp")
    ok = bool(rows) and rows[-1]["loss"] < rows[0]["loss"]
    return ("passed" if ok else "missed"), {"losses": [r["loss"] for r in rows]}, \
        f"{prepared['ranks']} ranks, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}" if rows else "no steps"


# ============================================================================================ inference

INJECTION_OP = "transformer_inference"  # DeepSpeed's fused inference kernels (InferenceBuilder), loaded by injection


def prepare_inference(ctx) -> dict:
    """Both runs on the bench model with as many key/value heads as query heads: DeepSpeed 0.19.8's HF Llama
    container sizes the fused qkv for that only (grouped-query attention is refused: issue 42)."""
    spec = {"model_dir": str(ctx.workdir / "generate_model"), "batch_sizes": [1, 8], "new_tokens": 64,
            "repeats": 2, "dtype": "fp16", "kv_heads": 8}
    decode_steps = (spec["repeats"] + 1) * 2 * spec["new_tokens"] * len(spec["batch_sizes"])  # + warm-up, 2 contenders
    return {**spec, "work": add_work({}, interpreter=2, generate_token=2 * decode_steps), "ops": [INJECTION_OP]}


def measure_inference(ctx, prepared, deadline):
    runs = {}
    for inject in (False, True):
        name = "inject" if inject else "plain"
        try:
            runs[name] = run_worker_item("inference", {**prepared, "kernel_inject": inject}, ctx,
                                         f"generate_{name}", deadline)
        except Exception as err:  # the injected run failing keeps the plain run's numbers
            raise PartialFailure(f"{name}: {err}", {"runs": runs}) from err
    worst = min(r["ratio"] for r in runs["plain"]["rows"])
    verdict = "; ".join(f"batch {p['batch']}: trainer {p['trainer']:.0f} tok/s, injected {i['trainer']:.0f}, "
                        f"transformers {p['transformers']:.0f}"
                        for p, i in zip(runs["plain"]["rows"], runs["inject"]["rows"]))
    return ("passed" if worst >= GOALS["generate_vs_transformers"] else "missed"), runs, verdict


def inference_worker(spec: dict) -> dict:
    import bench_generate
    model_dir = spec["model_dir"]
    if not Path(model_dir, "config.json").is_file():
        bench_generate.make_model(Path(model_dir), spec["kv_heads"])
    rows = [bench_generate.compare(model_dir, batch, spec["new_tokens"], spec["repeats"], spec["dtype"],
                                   spec["kernel_inject"]) for batch in spec["batch_sizes"]]
    return {"rows": rows}


# ============================================================================================ gpu tests

GPU_TESTS = REPO / "tests" / "test_gpu.py"
COVERED_BY_ITEMS = {"test_fp16_dynamic_loss_scaling_logs_the_scale": "fp16"}  # the same run, measured by the item
LAUNCHERS = {"train": "launch", "launch": "launch", "run_cli": "interpreter"}  # tests/test_gpu.py's helpers
FLAG_OPS = {"--kernel-inject": INJECTION_OP}  # a command-line flag a test passes -> the op it loads
XDIST_WORKERS = 3  # tiny runs side by side on one GPU: the launches' start-up is CPU work, 16 cores


def gpu_test_plan(path: Path = GPU_TESTS) -> dict[str, dict]:
    """Each test of tests/test_gpu.py read from its source: the launches and CLI runs it makes (calls of the
    LAUNCHERS helpers), the ops its flags load, and whether it needs flash-attn (it asks
    flash_attention_available)."""
    import ast
    tests = {}
    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
            continue
        calls = [n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        strings = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        work = {}
        for call in calls:
            if call in LAUNCHERS:
                add_work(work, **{LAUNCHERS[call]: 1})
        tests[node.name] = {"work": work, "ops": [op for flag, op in FLAG_OPS.items() if flag in strings],
                            "needs_flash": "flash_attention_available" in names}
    return tests


def prepare_gpu_tests(ctx) -> dict:
    tests = gpu_test_plan()
    unknown = sorted(set(COVERED_BY_ITEMS) - set(tests))
    if unknown:
        raise RuntimeError(f"COVERED_BY_ITEMS names tests that tests/test_gpu.py no longer has: {', '.join(unknown)}")
    deselected = {name: f"the {item} item runs it" for name, item in COVERED_BY_ITEMS.items()}
    deselected.update({name: FLASH_MISSING for name, t in tests.items() if t["needs_flash"] and not ctx.flash})
    chosen = {name: t for name, t in tests.items() if name not in deselected}
    xdist = ctx.dry_run or installed("pytest_xdist")  # the dry run plans for the GPU image, which has it
    workers = min(XDIST_WORKERS, len(chosen)) if xdist else 1
    work = add_work({}, test=1, interpreter=workers - 1)  # each xdist worker is an interpreter of its own
    for test in chosen.values():
        add_work(work, **{unit: count / workers for unit, count in test["work"].items()})
    ops = list(dict.fromkeys(launch_ops("tiny_cpu", tiny_overrides(ctx, 1), 1)
                             + [op for t in chosen.values() for op in t["ops"]]))
    command = [sys.executable, "-m", "pytest", "-m", "gpu", str(GPU_TESTS), "-q", "-rs", "-p", "no:cacheprovider"]
    if deselected:
        command += ["-k", " and ".join(f"not {name}" for name in deselected)]
    if workers > 1:
        command += ["-n", str(workers)]
    return {"command": command, "tests": sorted(chosen), "deselected": deselected, "workers": workers,
            "work": work, "ops": ops}


def pytest_counts(output: str) -> dict:
    """{'passed': n, 'failed': n, 'skipped': n, 'error': n} from pytest's last summary line."""
    last = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed|skipped)", line)), "")
    counts = {key: 0 for key in ("passed", "failed", "skipped", "error")}
    for number, key in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last):
        counts["error" if key.startswith("error") else key] += int(number)
    return counts


def measure_gpu_tests(ctx, prepared, deadline):
    """The tests in a session of their own (stopped with every launch at the deadline); the ops preflight built
    are the ones their launches load (TRAINER_TEST_OPS), on master ports of this item's range."""
    log = ctx.workdir / "gpu_tests.log"
    try:
        run_logged(prepared["command"], log, deadline, "pytest tests/test_gpu.py",
                   {"TRAINER_TEST_OPS": ",".join(ctx.ops), "TRAINER_TEST_PORT": str(ctx.next_port())})
        returncode = 0
    except RuntimeError:  # a failed test: its lines are in the log, counted below
        returncode = 1
    output = log.read_text(errors="replace")
    counts = pytest_counts(output)
    ok = returncode == 0 and counts["passed"] > 0 and counts["skipped"] == 0
    skips = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    failures = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    verdict = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, " \
              f"{counts['error']} errors" + "".join(f"; {line}" for line in failures)
    verdict += "".join(f"; {name} deselected: {why}" for name, why in prepared["deselected"].items())
    return ("passed" if ok else "missed"), {"counts": counts, "returncode": returncode, "skips": skips,
                                            "failures": failures, "tail": output[-3000:]}, verdict


# ============================================================================================ workers

WORKERS = {"memory": memory_worker, "kernels": kernels_worker, "inference": inference_worker}


def run_worker(name: str, spec_path: str, out: str) -> int:
    result = WORKERS[name](json.loads(Path(spec_path).read_text()))
    Path(out).write_text(json.dumps(result))
    return 0
