"""Benchmark the training loop against a minimal DeepSpeed loop and the HF Trainer (see scripts/README.md).

    .venv/bin/python scripts/bench.py --preset tiny_cpu --steps 40 --warmup 5 [--set k=v ...] [--ranks 2]

Three contenders train the same model (trainer.model.build_model: same init and dtype) on the same
micro-batches (trainer.data.MicroBatchLoader over the preset's prepared train set) with the same
resolved DeepSpeed JSON (micro-batch, grad accumulation, ZeRO stage, optimizer, scheduler) for the
same number of optimizer steps, each in its own `deepspeed --num_gpus R --master_port P` launch:

  trainer     trainer.train.run.run_training, the real thing (eval and checkpoint only at the end, untimed)
  minimal     the hand-written DeepSpeed loop in `minimal_worker` below
  hf_trainer  transformers.Trainer with TrainingArguments(deepspeed=<the same JSON>)

Each records on rank 0 the wall-clock time at the end of every optimizer step; throughput is taken
over the steps after `--warmup` (on CUDA the clock synchronizes at the two ends of that window).
This file is both the driver (no --worker) and the worker the launcher starts (--worker NAME).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONTENDERS = ("minimal", "trainer", "hf_trainer")
BUDGET_VS_MINIMAL = 0.03  # the issue: the loop may cost at most 3% against the minimal loop


# ============================================================================================ driver

def main(argv: list[str] | None = None) -> int:
    main_at = time.time()  # --first-step: the end of the interpreter's start-up
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny_cpu", help="preset name or path (default: tiny_cpu)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="preset override for all contenders (repeatable)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default: 40)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing (default: 5)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks to launch (default: the preset's hardware.nodes x gpus_per_node)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per contender, interleaved (default: 2)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated subset of {','.join(CONTENDERS)}")
    parser.add_argument("--port", type=int, default=29700, help="first --master_port; each launch takes the next")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for every rank (default: CPU cores / ranks, unless already set)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per launch (default: 1800)")
    parser.add_argument("--workdir", default=None, help="keep configs, logs and results here (default: a temp dir, removed)")
    parser.add_argument("--report-from", metavar="WORKDIR", default=None,
                        help="print the report again from a kept --workdir, without running anything")
    parser.add_argument("--first-step", action="store_true",
                        help="instead: time from process start to the first optimizer step of the trainer, by phase "
                             "(imports, process group, data open, model build, DeepSpeed initialize, first step), "
                             "--repeats launches")
    parser.add_argument("--worker", choices=CONTENDERS + ("first_step",), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "first_step":
        return run_first_step_worker(json.loads(Path(args.spec).read_text()), Path(args.out), main_at)
    if args.worker:
        return run_worker(args.worker, json.loads(Path(args.spec).read_text()), Path(args.out))
    from trainer.errors import UserError
    try:
        return report_from(Path(args.report_from)) if args.report_from else drive(args)
    except UserError as err:  # a bad preset/--set/--steps combination: say so, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


def drive(args) -> int:
    from trainer.presets import load_preset, with_overrides
    from trainer.resolve import declared_world_size, resolve

    contenders = ["first_step"] if args.first_step else \
        list(dict.fromkeys(c.strip() for c in args.contenders.split(",") if c.strip()))
    unknown = sorted(set(contenders) - set(CONTENDERS) - ({"first_step"} if args.first_step else set()))
    if unknown or not contenders:
        sys.exit(f"--contenders: unknown {unknown}; choose from {', '.join(CONTENDERS)}")
    if not 0 <= args.warmup < args.steps:
        sys.exit(f"--warmup {args.warmup} must be in [0, --steps {args.steps})")

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    stop_after = 1 if args.first_step else "null"  # --first-step: the run as configured, ended after step 1
    overrides = with_overrides(args.overrides, [
        f"train.max_steps={args.steps}", "train.eval_every=0", "train.save_every=0", f"train.stop_after={stop_after}",
        "train.export_hf=false", "train.resume=null", "logging.progress_bar=false", "logging.wandb_mode=disabled"])
    config = load_preset(args.preset, overrides)
    ranks = args.ranks or declared_world_size(config)
    resolved = resolve(config, ranks)  # once: every contender gets this DeepSpeed JSON
    ds_path = workdir / "ds_config.json"
    ds_path.write_text(json.dumps(resolved.ds, indent=2) + "\n")
    cfg, batch = resolved.config, resolved.batch
    spec = {"preset": args.preset, "overrides": overrides, "world_size": ranks, "steps": args.steps,
            "warmup": args.warmup, "ds_config": str(ds_path), "workdir": str(workdir)}
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
    if args.threads or "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(args.threads or max(1, cores // ranks))

    print(f"bench: preset {args.preset}, {ranks} ranks, ZeRO {resolved.summary()['zero_stage']}, "
          f"{resolved.summary()['precision']}, micro {batch.micro_batch_size} x accum {batch.grad_accum} x dp "
          f"{batch.data_parallel_size} = {batch.global_batch_size} seqs x {cfg.data.seq_len} tokens = "
          f"{resolved.tokens_per_step} tokens/step; {args.steps} steps, first {args.warmup} untimed; "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}; code {code_version()}; workdir {workdir}", flush=True)

    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    failures = 0
    port = args.port
    for rep in range(args.repeats):
        order = contenders[rep % len(contenders):] + contenders[:rep % len(contenders)]  # rotate: no fixed slot
        for name in order:
            out = workdir / f"{name}_{rep}.json"
            log = workdir / f"{name}_{rep}.log"
            cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port",
                   str(port), str(Path(__file__).resolve()), "--worker", name, "--spec", str(spec_path),
                   "--out", str(out)]
            port += 1
            out.unlink(missing_ok=True)
            started = time.time()
            rc = launch(cmd, {**env, "BENCH_LAUNCHED_AT": repr(started)}, log, args.timeout)
            if not out.exists():  # rank 0 writes it only after the last step: no file, no complete run
                failures += 1
                tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
                print(f"  {name} run {rep + 1}: FAILED ({rc}); last lines of {log}:\n{tail}", flush=True)
                continue
            if rc != 0:
                print(f"  note: {name} run {rep + 1} exited with {rc} after its last step (at shutdown); see {log}")
            if args.first_step:
                runs[name].append(json.loads(out.read_text()))
                print(f"  first step run {rep + 1}: {runs[name][-1]['total_s']:.2f} s from process start", flush=True)
                continue
            result = summarize(json.loads(out.read_text()), args.warmup, args.steps)
            runs[name].append(result)
            print(f"  {name:<10} run {rep + 1}: {result['tokens_per_s']:>10,.0f} tokens/s, "
                  f"{result['step_s'] * 1e3:8.1f} ms/step (median step {result['median_step_s'] * 1e3:.1f} ms, "
                  f"p10-p90 {result['p10_step_s'] * 1e3:.1f}-{result['p90_step_s'] * 1e3:.1f}), "
                  f"outside engine {result['outside_s'] * 1e3:.2f} ms/step, "
                  f"launch {time.time() - started:.0f} s", flush=True)

    if args.first_step:
        from first_step import print_first_step
        if runs["first_step"]:
            print_first_step(runs["first_step"], args.preset, ranks)
    else:
        print_report(runs, resolved, args)
    if failures:
        print(f"{failures} launch(es) failed; logs in {workdir}")
    elif not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failures else 0


def report_from(workdir: Path) -> int:
    """The table of an earlier run, from the spec and raw per-run results it left in its workdir."""
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    spec = json.loads((workdir / "spec.json").read_text())
    resolved = resolve(load_preset(spec["preset"], spec["overrides"]), spec["world_size"])
    runs: dict[str, list[dict]] = {}
    for name in CONTENDERS:
        for path in sorted(workdir.glob(f"{name}_*.json"), key=lambda p: int(p.stem.rsplit("_", 1)[1])):
            runs.setdefault(name, []).append(summarize(json.loads(path.read_text()), spec["warmup"], spec["steps"]))
    print_report(runs, resolved, argparse.Namespace(warmup=spec["warmup"], steps=spec["steps"]))
    return 0


def launch(cmd: list[str], env: dict, log: Path, timeout: int):
    """Run one launcher in its own session; a timeout takes its ranks down with it, and whatever it left running
    after it exited goes too (trainer.process_tree.stop_tree: the ranks and their compilers, not just the group)."""
    from trainer.process_tree import stop_tree
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout"
        finally:
            stop_tree(proc.pid)
            proc.wait()


def code_version() -> str:
    """The commit, and whether the loop differs from it: results belong to the code that produced them."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" + uncommitted trainer/ changes" if git("status", "--porcelain", "trainer") else "")


def summarize(raw: dict, warmup: int, steps: int) -> dict:
    times, engine = raw["step_end_times"], raw["engine_seconds"]  # [k] = at the end of optimizer step k + 1
    if len(times) != steps:
        raise RuntimeError(f"{raw['contender']}: recorded {len(times)} step ends, expected {steps}")
    start = times[warmup - 1] if warmup else raw["loop_start_time"]
    window = times[-1] - start
    steps_timed = steps - warmup
    outside = (window - (engine[-1] - (engine[warmup - 1] if warmup else 0.0))) / steps_timed
    durations = sorted(b - a for a, b in zip([start] + times[warmup:-1], times[warmup:]))
    return {**raw, "tokens_per_s": steps_timed * raw["tokens_per_step"] / window, "step_s": window / steps_timed,
            "outside_s": outside, "median_step_s": statistics.median(durations),
            "p10_step_s": _quantile(durations, 0.1), "p90_step_s": _quantile(durations, 0.9)}


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def print_report(runs: dict[str, list[dict]], resolved, args) -> None:
    from trainer.train.metrics import flops_per_token

    best = {name: max(results, key=lambda r: r["tokens_per_s"]) for name, results in runs.items() if results}
    any_result = next(iter(best.values()), None)
    if any_result is None:
        print("no contender finished")
        return
    cfg = resolved.config
    fpt = flops_per_token(any_result["num_params"], cfg.model.num_layers, cfg.model.hidden_size, cfg.data.seq_len)
    peak = peak_tflops(any_result.get("device_name"), cfg.hardware.gpu) if any_result.get("cuda") else None
    # Host work outside the engine only grows when a neighbour takes the CPU: the least of the runs
    # is the best estimate of what the loop itself costs.
    outside = {name: min(r["outside_s"] for r in results) for name, results in runs.items() if results}
    reference = best.get("minimal")

    print(f"\n{'contender':<11} {'tokens/s':>9} {'step ms':>8} {'vs minimal':>10} {'MFU':>6} {'outside engine':>14} "
          f"{'median step':>11}  {'runs: tokens/s (spread)':<32} {'first loss':>10} {'threads':>7}")
    for name in CONTENDERS:
        if name not in runs:
            continue
        results = runs[name]
        if not results:
            print(f"{name:<11} {'failed':>9}")
            continue
        b = best[name]
        ratio = f"{b['tokens_per_s'] / reference['tokens_per_s']:.3f}" if reference else "-"
        mfu = f"{b['tokens_per_s'] * fpt / (peak * 1e12 * b['world_size']) * 100:.1f}%" if peak else "-"
        values = [r["tokens_per_s"] for r in results]
        runs_text = ", ".join(f"{v:,.0f}" for v in values) + f" ({(max(values) - min(values)) / max(values):.1%})"
        print(f"{name:<11} {b['tokens_per_s']:>9,.0f} {b['step_s'] * 1e3:>8.1f} {ratio:>10} {mfu:>6} "
              f"{outside[name] * 1e3:>11.2f} ms {b['median_step_s'] * 1e3:>8.1f} ms  {runs_text:<32} "
              f"{b['first_loss']:>10.6f} {b['threads']:>7}")

    print(f"\ntokens/s, step ms: steps {args.warmup + 1}..{args.steps} ({resolved.tokens_per_step} tokens each), best of "
          f"{len(next(iter(runs.values())))} runs; spread = (max - min) / max over the runs. outside engine = host time "
          f"per step outside DeepSpeedEngine.forward/backward/step (least over the runs).")
    if peak:
        print(f"MFU = tokens/s x {fpt:.4g} FLOPs/token (trainer.train.metrics.flops_per_token) / "
              f"({peak:g} TFLOP/s x {any_result['world_size']} GPUs)")
    else:
        print("MFU: CPU ranks, no peak to compare against")
    spreads = [(max(v) - min(v)) / max(v) for v in
               ([r["tokens_per_s"] for r in results] for results in runs.values() if len(results) > 1)]
    noise = f"runs of one contender differ by up to {max(spreads):.1%}" if spreads else "one run each: no spread known"
    ours = best.get("trainer")
    if ours and reference:
        ratio = ours["tokens_per_s"] / reference["tokens_per_s"]
        extra = outside["trainer"] - outside["minimal"]
        extra_share = extra / reference["median_step_s"]
        print(f"trainer vs minimal: {ratio:.3f}x throughput, i.e. costs {1 - ratio:+.1%} "
              f"({'within' if 1 - ratio <= BUDGET_VS_MINIMAL else 'OVER'} the {BUDGET_VS_MINIMAL:.0%} budget; {noise}); "
              f"the loop's own extra host work: {extra * 1e3:+.2f} ms/step = {extra_share:+.2%} of a step "
              f"({'within' if extra_share <= BUDGET_VS_MINIMAL else 'OVER'} budget)")
    if ours and "hf_trainer" in best:
        ratio = ours["tokens_per_s"] / best["hf_trainer"]["tokens_per_s"]
        verdict = "OK" if ratio >= 1 else ("slower by less than the run-to-run spread" if spreads and 1 - ratio
                                           < max(spreads) else "SLOWER")
        extra = outside["trainer"] - outside["hf_trainer"]
        print(f"trainer vs hf_trainer: {ratio:.3f}x throughput ({verdict}; must be >= 1); "
              f"host work outside the engine {extra * 1e3:+.2f} ms/step")
    losses = {name: b["first_loss"] for name, b in best.items()}
    if len({round(v, 4) for v in losses.values()}) > 1:
        print(f"note: first-step losses differ ({losses}): the contenders did not start from the same work")


def peak_tflops(device_name: str | None, preset_gpu: str) -> float | None:
    """Peak 16-bit TFLOP/s of the GPU the workers ran on (by name), else of the preset's hardware.gpu."""
    from trainer.hardware import GPUS, gpu_of_device
    gpu = gpu_of_device(device_name) or GPUS.get(preset_gpu)
    return gpu.peak_tflops if gpu and gpu.peak_tflops else None


# ============================================================================================ worker

class StepClock:
    """Wall-clock time at the end of every optimizer step (rank 0 keeps them), and how much of it was
    spent inside DeepSpeedEngine.forward/backward/step. The rest ("outside engine") is the loop's own
    host work: data, device copies, bookkeeping, logging; it is small and far less sensitive to CPU
    contention than the step time. On CUDA the clock synchronizes only at the ends of the timed window,
    so the loop between is not changed by the measurement (the engine split is then host time only)."""

    def __init__(self, warmup: int, steps: int):
        import torch
        self.cuda = torch.cuda.is_available()
        self.sync_at = {warmup, steps}
        self.times: list[float] = []
        self.engine_times: list[float] = []  # cumulative seconds inside engine calls, at each tick
        self.engine_s = 0.0
        self.loop_start = None

    def start(self) -> None:
        self._sync()
        self.loop_start = time.perf_counter()

    def tick(self, step: int) -> None:
        if step in self.sync_at:
            self._sync()
        self.times.append(time.perf_counter())
        self.engine_times.append(self.engine_s)

    def time_engine_calls(self) -> None:
        """Wrap DeepSpeedEngine's forward/backward/step for all three contenders alike: the HF Trainer builds
        and drives its engine itself, so DeepSpeed's class is the one place to time all three the same way
        (our own code is watched through its hooks, never patched)."""
        from deepspeed.runtime.engine import DeepSpeedEngine
        for name in ("forward", "backward", "step"):
            setattr(DeepSpeedEngine, name, self._timed(getattr(DeepSpeedEngine, name)))

    def _timed(self, method):
        import functools

        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.engine_s += time.perf_counter() - start
        return timed

    def _sync(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize()


class ModelProbe:
    """Attached to every contender's model as built: its parameter count and, through a forward hook removed
    after one call, the rank's loss on its first micro-batch (a check that all contenders did the same work)."""

    def __init__(self):
        self.first_loss = None
        self.loss_scale = 1.0  # what the caller multiplies the model's loss by before backward
        self.num_params = None
        self._handle = None

    def attach(self, model) -> None:
        from trainer.model import count_parameters
        self.num_params = count_parameters(model)[0]
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        loss = getattr(output, "loss", None)
        if loss is not None and module.training:
            self.first_loss = float(loss.detach()) * self.loss_scale
            self._handle.remove()


def run_first_step_worker(spec: dict, out: Path, main_at: float) -> int:
    """The trainer to the end of its first step under scripts/first_step.py's clock; rank 0 writes the split."""
    from first_step import first_step_worker
    launched = os.environ.get("BENCH_LAUNCHED_AT")
    result = first_step_worker({**spec, "run_dir": str(out.with_suffix("")),
                                "launched_at": float(launched) if launched else None}, main_at)
    import torch.distributed as dist
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_worker(name: str, spec: dict, out: Path) -> int:
    import torch
    import torch.distributed as dist

    probe = ModelProbe()
    clock = StepClock(spec["warmup"], spec["steps"])
    clock.time_engine_calls()
    ds_config = json.loads(Path(spec["ds_config"]).read_text())
    worker = {"trainer": trainer_worker, "minimal": minimal_worker, "hf_trainer": hf_trainer_worker}[name]
    spec = {**spec, "run_dir": str(out.with_suffix(""))}  # this launch's output_dir (trainer, HF)
    resolved = worker(spec, ds_config, clock, probe)

    if dist.get_rank() == 0:
        out.write_text(json.dumps({
            "contender": name, "step_end_times": clock.times, "loop_start_time": clock.loop_start,
            "engine_seconds": clock.engine_times,
            "tokens_per_step": resolved.tokens_per_step, "num_params": probe.num_params,
            "first_loss": probe.first_loss, "threads": torch.get_num_threads(), "world_size": dist.get_world_size(),
            "cuda": torch.cuda.is_available(),
            "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}))
    dist.barrier()  # an orderly shutdown: a rank exiting mid-collective aborts the other
    dist.destroy_process_group()
    return 0


def setup(spec: dict, ds_config: dict, probe: ModelProbe):
    """The resolved config (checked against the driver's JSON), process group, data and model, built
    as run_training builds them (same seeding, same dataset, same build_model)."""
    import deepspeed
    import torch.distributed as dist
    from trainer.data import apply_chat_template, build_datasets, load_tokenizer
    from trainer.distributed import seed_everything

    resolved = resolve_checked(spec, ds_config)
    if not dist.is_initialized():
        deepspeed.init_distributed()
    rank = dist.get_rank()
    cfg = resolved.config
    seed_everything(cfg.train.seed, rank)
    tokenizer = apply_chat_template(load_tokenizer(cfg.model), cfg.data)
    data = build_datasets(cfg.data, tokenizer, cfg.train.seed)  # collective
    from trainer.model import build_model
    model, hf_ds_config = build_model(cfg, rank)
    probe.attach(model)
    return resolved, data, model, hf_ds_config


def resolve_checked(spec: dict, ds_config: dict):
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    return check_same_json(resolve(load_preset(spec["preset"], spec["overrides"]), spec["world_size"]), ds_config)


def check_same_json(resolved, ds_config: dict):
    if json.loads(json.dumps(resolved.ds)) != ds_config:
        raise RuntimeError("this worker resolved a different DeepSpeed config than the driver exported")
    return resolved


def minimal_worker(spec: dict, ds_config: dict, clock: StepClock, probe: ModelProbe):
    """The reference: deepspeed.initialize + forward/backward/step, nothing else in the loop."""
    import deepspeed
    import torch.distributed as dist
    from trainer.data import MicroBatchLoader

    resolved, data, model, _hf_ds_config = setup(spec, ds_config, probe)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config)
    dp_rank = engine.get_data_parallel_rank() if engine.autotp_size() > 1 else dist.get_rank()
    train = resolved.config.train
    batches = iter(MicroBatchLoader(data.train, train.micro_batch_size, dp_rank,
                                    resolved.batch.data_parallel_size, train.grad_accum))
    engine.train()
    clock.start()
    for step in range(1, spec["steps"] + 1):
        for _ in range(train.grad_accum):
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in next(batches).items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
        clock.tick(step)
    return resolved


def trainer_worker(spec: dict, ds_config: dict, clock: StepClock, probe: ModelProbe):
    """trainer.train.run.run_training unchanged, watched through its hooks: the clock ticks in `after_step`,
    which fit() calls once per optimizer step right after it; the final eval and checkpoint come after the
    last tick (untimed)."""
    from trainer.train.hooks import Hooks
    from trainer.train.run import run_training

    class BenchHooks(Hooks):
        resolved = None

        def on_resolved(self, resolved):
            self.resolved = check_same_json(resolved, ds_config)

        def on_model(self, model):
            probe.attach(model)

        def after_step(self, engine, step):
            if clock.loop_start is None:  # approximate (fit's set-up came before): used only with --warmup 0
                clock.loop_start = time.perf_counter()
            clock.tick(step)

    hooks = BenchHooks()
    from trainer.presets import with_overrides
    overrides = with_overrides(spec["overrides"], [f"train.output_dir={spec['run_dir']}"])
    exit_code = run_training(spec["preset"], overrides, world_size=spec["world_size"], hooks=hooks)
    if exit_code:
        raise RuntimeError(f"run_training returned {exit_code}")
    return hooks.resolved

def hf_trainer_worker(spec: dict, ds_config: dict, clock: StepClock, probe: ModelProbe):
    """transformers.Trainer on the same JSON, fed the same micro-batches (MicroBatchLoader, not re-sharded)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from trainer.data import MicroBatchLoader

    t = resolve_checked(spec, ds_config).config.train
    accelerator_config = None
    if not torch.cuda.is_available():
        # Accelerate 1.15 picks no backend for DeepSpeed on CPU ranks and then counts 1 process (the
        # Trainer would reject the JSON's train_batch_size). Start its state with gloo ourselves and
        # have TrainingArguments take it over (accelerator_config use_configured_state).
        from accelerate import PartialState
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
        accelerator_config = {"use_configured_state": True}
    # TrainingArguments before the model: at ZeRO-3 it starts transformers' integration. Every value the
    # DeepSpeed JSON also holds must match it, or the Trainer refuses the JSON.
    args = TrainingArguments(
        output_dir=spec["run_dir"], deepspeed=spec["ds_config"],
        per_device_train_batch_size=t.micro_batch_size, gradient_accumulation_steps=t.grad_accum,
        max_steps=spec["steps"], learning_rate=t.lr, weight_decay=t.weight_decay, adam_beta1=t.betas[0],
        adam_beta2=t.betas[1], adam_epsilon=t.eps, max_grad_norm=t.grad_clip, warmup_steps=t.warmup_steps,
        bf16=t.precision == "bf16", fp16=t.precision == "fp16", seed=t.seed, logging_strategy="no",
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False, accelerator_config=accelerator_config)
    resolved, data, model, hf_ds_config = setup(spec, ds_config, probe)
    loader = MicroBatchLoader(data.train, t.micro_batch_size, args.process_index,
                              resolved.batch.data_parallel_size, t.grad_accum)

    class SameBatches:  # no __len__: the Trainer runs max_steps over an endless iterator
        def __iter__(self):
            return iter(loader)

    class SameBatchesTrainer(Trainer):
        def get_train_dataloader(self):
            return SameBatches()

    class StepEnd(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick(state.global_step)

    hf_trainer = SameBatchesTrainer(model=model, args=args, train_dataset=data.train, callbacks=[StepEnd()])
    if hf_trainer.model_accepts_loss_kwargs and args.average_tokens_across_devices:
        probe.loss_scale = args.world_size  # the model divides by all ranks' tokens; compute_loss scales back
    hf_trainer.train()
    del hf_ds_config
    return resolved


if __name__ == "__main__":
    sys.exit(main())
