"""GPU acceptance in one command: MFU, planner vs measured memory, kernels, fp16, inference, the gpu tests.

    .venv/bin/python scripts/gpu_check.py [-o gpu_check.json] [--only ITEM,...] [--skip ITEM,...]
    .venv/bin/python scripts/gpu_check.py --cpu-dry-run -o /tmp/gpu_check.json    # the plan: work and budgets

Made for one H100/H200-class GPU with 16 CPU cores and at most 8 minutes (TOTAL_BUDGET_S). It runs in two phases:

  plan      every item's `prepare` (CPU: synthetic corpus, planner rows, resolved launch configurations) says the
            work it will do as counts of units (launches, 1B-model tokens, op builds, ...); each unit's seconds
            on one H200 (gpu_check_items.UNIT_SECONDS, from the GPU run in docs/gpu-acceptance.md) give the
            item's estimate, and the estimate x MARGIN its budget. The plan table (work, estimate and budget per
            item, their total against the 480 s) is printed first; --cpu-dry-run stops after it.
  measure   each item's `measure` runs in a process of its own (its own session, a marker in its environment);
            an item that outgrows its budget ends `timeout` and everything it started is stopped
            (trainer.process_tree.stop_all): no launch keeps the GPU for the next item.

Preflight runs first: versions found next to the pins (a different installed stack is reported, not refused),
flash-attn and Liger as the trainer will see them, and every DeepSpeed op the planned items load, built once so
the timed items do not pay for it. Each item ends as one of

  passed    measured, and the goal is met
  missed    measured, and the goal is not met (the numbers are in the report)
  error     it raised or a subprocess failed: the message names what
  timeout   it ran past its budget and was stopped with everything it started
  skipped   not run, always with the reason (--skip, --cpu-dry-run, flash-attn not installed, one GPU for ZeRO++)

Exit code: 0 when nothing errored, timed out or missed, 1 when an item errored or timed out (named on stderr), 3
when every item ran but a goal was missed, 2 for bad arguments or when no CUDA GPU is visible (without
--cpu-dry-run). The report is one JSON file written atomically (trainer.files.write_text_atomic); a short table is
printed at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import multiprocessing
import os
import platform
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional


REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [p for p in (str(REPO), str(REPO / "scripts")) if p not in sys.path]

import gpu_check_items as items_mod  # noqa: E402 - scripts/ is not a package: found through the path above


SCHEMA = "gpu_check/2"
TOTAL_BUDGET_S = 480
MARGIN = 1.5          # an item's budget: its estimate x MARGIN, rounded up to BUDGET_STEP_S
BUDGET_STEP_S = 5
STATUSES = ("passed", "missed", "error", "timeout", "skipped")
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_MISSED = 0, 1, 2, 3
MARKER_VAR = "GPU_CHECK_ITEM"  # in every item process's environment, inherited by all it starts


@dataclass(frozen=True)
class Item:
    name: str
    what: str
    goal: str
    prepare: Callable  # (ctx) -> dict with "work" ({unit: count}) and, where it loads any, "ops": CPU-checkable
    measure: Callable  # (ctx, prepared, deadline) -> (status, measurements, verdict); GPU, in a process of its own
    plans_last: bool = False  # planned after the others: its work follows from theirs (preflight builds their ops)


# The order they run in: the short items first, so a check stopped from outside has measured the most.
ITEMS: tuple[Item, ...] = (
    Item("preflight", "CUDA device, versions found vs pinned, flash-attn and liger-kernel as the trainer sees them; "
         "every DeepSpeed op the planned items load built here (JIT, cached), so the timed items do not pay for it",
         "every op builds", items_mod.prepare_preflight, items_mod.measure_preflight, plans_last=True),
    Item("memory", "torch.cuda.max_memory_allocated vs the planner's per-GPU total, 4 configurations",
         "every row within 10%", items_mod.prepare_memory, items_mod.measure_memory),
    Item("kernels", "flash-attn and Liger by what executed: attention implementation, module types, "
         "profiler kernel names", "flash_attn's own kernels and Liger's kernels in the trace",
         items_mod.prepare_kernels, items_mod.measure_kernels),
    Item("fp16", "fp16 with dynamic loss scaling (7b_2xv100's fp16 block, ZeRO-3), tiny model",
         "loss scale logged on every step, loss falls", items_mod.prepare_fp16, items_mod.measure_fp16),
    Item("zeropp", "ZeRO++ quantized weights (zero_quantized_weights) on the GPUs present",
         "trains, loss falls", items_mod.prepare_zeropp, items_mod.measure_zeropp),
    Item("throughput", "1B Llama (1b_pretrain_8xh100 shape), 1 GPU, bf16, seq 4096, synthetic tokens: "
         "sdpa, sdpa + Liger, flash-attn 2, flash-attn 2 + Liger (those installed), and for the best one the "
         "minimal DeepSpeed loop and HF Trainer (scripts/bench.py)",
         ">= 50% MFU with flash-attn + Liger; loop >= 0.99x minimal; >= 1.05x HF Trainer",
         items_mod.prepare_throughput, items_mod.measure_throughput),
    Item("inference", "`trainer generate` tokens/s with and without kernel injection, next to transformers "
         "generate (scripts/bench_generate.py)", "trainer >= 0.95x transformers without injection",
         items_mod.prepare_inference, items_mod.measure_inference),
    Item("gpu_tests", "pytest -m gpu tests/test_gpu.py (less the tests an item above already runs)",
         "all pass, none skipped", items_mod.prepare_gpu_tests, items_mod.measure_gpu_tests),
)


@dataclass
class Context:
    """What every item sees: the work directory, the dry-run flag, the GPU, and what the plan found."""
    workdir: Path
    dry_run: bool
    port: int = 30500
    device_name: str = "cpu"
    gpu_count: int = 0
    flash: bool = False   # flash_attention_2 will run (trainer.model.flash_attention_available; assumed in a dry run)
    liger: bool = False   # liger-kernel is installed (assumed in a dry run)
    ops: tuple[str, ...] = ()  # every DeepSpeed op the planned items load (preflight builds them)
    notes: list[str] = field(default_factory=list)

    def next_port(self) -> int:
        self.port += 1
        return self.port


# ============================================================================================ arguments

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="gpu_check.json", help="the JSON report (default: gpu_check.json)")
    parser.add_argument("--workdir", default=None, help="keep corpora, configs and logs here (default: a temp dir)")
    parser.add_argument("--only", default="", help="comma-separated items to run (the rest: skipped, with why)")
    parser.add_argument("--skip", default="", help="comma-separated items not to run (recorded as skipped)")
    parser.add_argument("--budget", type=float, default=TOTAL_BUDGET_S,
                        help=f"seconds the whole check may take (default {TOTAL_BUDGET_S}); items that would not fit "
                             f"are deferred, with the --only line that runs them next")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="no GPU: run every item's CPU-checkable part on tiny sizes, skip the measurements")
    parser.add_argument("--port", type=int, default=30500, help="first master port for launches (default: 30500)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [i.name for i in ITEMS]
    for flag in ("only", "skip"):
        chosen = [n.strip() for n in getattr(args, flag).split(",") if n.strip()]
        unknown = [n for n in chosen if n not in names]
        if unknown:
            parser.error(f"--{flag}: unknown item(s) {', '.join(unknown)}; items: {', '.join(names)}")
        setattr(args, flag, chosen)
    return args


def refusal(cuda_available: bool, dry_run: bool) -> Optional[str]:
    """Why this machine cannot run the check as asked, or None."""
    if cuda_available or dry_run:
        return None
    import torch
    return (f"gpu_check: no CUDA GPU is visible (torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
            f"It measures what only a GPU can show: run it on a machine with one H100/H200-class GPU after "
            f"`pip install torch` (a CUDA build) and `pip install -e '.[gpu,test]'`; on CPU, "
            f"`--cpu-dry-run` checks the script itself (plan rows, synthetic data, report) without measuring.")


# ============================================================================================ plan

def selected(item: Item, args) -> Optional[str]:
    """Why `item` is not run (a skip reason), or None."""
    if args.only and item.name not in args.only:
        return f"not in --only {','.join(args.only)}"
    if item.name in args.skip:
        return "--skip on the command line"
    return None


def budget_for(estimate_s: float, margin: float = MARGIN) -> float:
    return float(max(BUDGET_STEP_S, math.ceil(estimate_s * margin / BUDGET_STEP_S) * BUDGET_STEP_S))


def plan_item(item: Item, ctx: Context, skip_reason: Optional[str], clock=time.monotonic) -> dict:
    """One item's row with its plan: what `prepare` built, its work, estimate and budget (or the skip reason, or
    the error `prepare` raised, named); never raises."""
    row = {"name": item.name, "what": item.what, "goal": item.goal, "status": "skipped", "work": {},
           "estimate_s": 0.0, "budget_s": 0.0, "prepare_s": 0.0, "duration_s": 0.0, "measurements": {},
           "verdict": "", "reason": skip_reason or ""}
    if skip_reason:
        return row
    started = clock()
    try:
        prepared = item.prepare(ctx)
        row["measurements"]["prepared"] = prepared
        if prepared.get("skip"):  # nothing of it can run here (ZeRO++ on one GPU): no process, no budget
            row["reason"] = prepared["skip"]
        else:
            work = prepared.get("work", {})
            estimate = items_mod.estimate_seconds(work)
            row.update(status="planned", work=work, estimate_s=round(estimate, 1), budget_s=budget_for(estimate))
    except Exception as err:  # any failure becomes this item's error, named; the other items still run
        row.update(status="error", verdict=f"prepare failed: {type(err).__name__}: {err}",
                   traceback=traceback.format_exc(limit=8))
    row["prepare_s"] = round(clock() - started, 2)
    return row


def plan_all(items: tuple[Item, ...], ctx: Context, args) -> list[dict]:
    """Every item's row, in the items' order; those that plan last see the ops the others load (ctx.ops). Items that
    would take the plan past the budget (--budget) are deferred, in the items' order, with the command that runs
    them next: a lent GPU's time is counted, and a check stopped from outside half-way measures less than one
    that planned to fit."""
    rows: dict[str, dict] = {}
    deferred: dict[str, str] = {}
    while True:
        for item in sorted(items, key=lambda i: i.plans_last):
            if item.plans_last:
                ctx.ops = planned_ops(rows[i.name] for i in items if not i.plans_last)
            rows[item.name] = plan_item(item, ctx, deferred.get(item.name) or selected(item, args))
        over = over_budget([rows[item.name] for item in items], [i.plans_last for i in items], args.budget)
        if not over:
            return [rows[item.name] for item in items]
        later = ",".join(over)  # the first of them may fit alone in a run of its own
        deferred.update({name: f"deferred: past the {args.budget:g} s budget with the items before it; run it next: "
                               f"scripts/gpu_check.py --only preflight,{later}" for name in over})


def over_budget(rows: list[dict], first: list[bool], budget: float) -> list[str]:
    """The planned rows, in order, that no longer fit once those before them have their budgets (the rows planned
    first - preflight, which builds the ops of the rest - always stay)."""
    spent = sum(r["budget_s"] + r["prepare_s"] for r, keep in zip(rows, first) if keep)
    over = []
    for row, keep in zip(rows, first):
        if keep or row["status"] != "planned":
            spent += 0 if keep else row["prepare_s"]
            continue
        spent += row["budget_s"] + row["prepare_s"]
        if over or spent > budget:
            over.append(row["name"])
    return over


def planned_ops(rows) -> tuple[str, ...]:
    return tuple(dict.fromkeys(op for row in rows if row["status"] == "planned"
                               for op in row["measurements"]["prepared"].get("ops", ())))


def plan_total(rows: list[dict]) -> float:
    """The seconds the whole check may take: every item's budget and its prepare time."""
    return sum(r["budget_s"] + r["prepare_s"] for r in rows)


def plan_table(rows: list[dict], total: float = TOTAL_BUDGET_S) -> str:
    lines = [f"{'item':<11} {'estimate':>8} {'budget':>6}  work (units x count; seconds per unit: UNIT_SECONDS)"]
    for row in rows:
        work = ", ".join(f"{unit} x{count:g}" for unit, count in row["work"].items()) or \
            (row["reason"] or row["verdict"])
        lines.append(f"{row['name']:<11} {row['estimate_s']:>8.0f} {row['budget_s']:>6.0f}  {work}")
    planned = plan_total(rows)
    lines.append(f"planned {planned:.0f} s (budgets {MARGIN:g}x the estimates, and {sum(r['prepare_s'] for r in rows):.0f} s"
                 f" of planning) of the {total} s budget: " + ("fits" if planned <= total else "OVER"))
    return "\n".join(lines)


# ============================================================================================ measure

def measure_item(item: Item, ctx: Context, row: dict, clock=time.monotonic) -> dict:
    """Measure a planned row in a process of its own, stopped with all it started at the row's budget."""
    if row["status"] != "planned":
        return row
    if ctx.dry_run:
        row.update(status="skipped", reason="--cpu-dry-run: the measurement needs a CUDA GPU (prepared part checked)")
        return row
    started = clock()
    deadline = started + row["budget_s"]
    outcome = isolated(item.measure, ctx, row["measurements"]["prepared"], deadline, f"{item.name}-{os.getpid()}")
    row["duration_s"] = round(clock() - started, 2)
    kind = outcome[0]
    if kind == "timeout":
        row.update(status="timeout", verdict=f"ran past its {row['budget_s']:.0f} s budget (estimate "
                                             f"{row['estimate_s']:.0f} s); stopped {outcome[1]} processes",
                   left_running=outcome[2])
    elif kind == "raised":
        _, message, trace, measurements = outcome
        row.update(status="error", verdict=f"measure failed: {message}", traceback=trace)
        row["measurements"].update(measurements)  # what a partly failed item did measure
    else:
        _, status, measurements, verdict = outcome
        if status not in STATUSES:
            row.update(status="error", verdict=f"measure failed: RuntimeError: returned unknown status {status!r}")
            return row
        row.update(status=status, verdict=verdict)
        row["measurements"].update(measurements)
        if status == "skipped":
            row["reason"] = verdict
    return row


def isolated(measure: Callable, ctx: Context, prepared: dict, deadline: float, marker: str) -> tuple:
    """Run `measure` in a fresh interpreter (spawn: no CUDA state shared with this process) in a session of its
    own, with `marker` in its environment. Returns ("done", status, measurements, verdict), ("raised", message,
    traceback, measurements) or ("timeout", processes stopped, processes still found afterwards); in every
    case nothing it started is left running."""
    from trainer.process_tree import leftovers, stop_all
    spawn = multiprocessing.get_context("spawn")
    receive, send = spawn.Pipe(duplex=False)
    child = spawn.Process(target=_item_process, args=(measure, ctx, prepared, deadline, marker, send))
    child.start()
    send.close()
    try:
        if receive.poll(max(0.0, deadline - time.monotonic())):  # a result, or the child's end (EOF)
            try:
                return receive.recv()
            except EOFError:
                child.join(10)
                return ("raised", f"the item's process died (exit code {child.exitcode}) without a result",
                        "", {})
        stopped = stop_all(child.pid, marker)
        return "timeout", stopped, leftovers(marker)
    finally:
        stop_all(child.pid, marker)
        child.join(10)
        receive.close()


def _item_process(measure: Callable, ctx: Context, prepared: dict, deadline: float, marker: str, send) -> None:
    os.setsid()  # its own session: stop_tree finds the launches it starts even after they are orphaned
    os.environ[MARKER_VAR] = marker  # ...and a daemon that left the session, by its inherited environment
    try:
        status, measurements, verdict = measure(ctx, prepared, deadline)
        send.send(("done", status, items_mod.plain({**measurements, "timings": items_mod.TIMINGS}), verdict))
    except Exception as err:
        measured = {**getattr(err, "measurements", {}), "timings": items_mod.TIMINGS}
        send.send(("raised", f"{type(err).__name__}: {err}", traceback.format_exc(limit=8), items_mod.plain(measured)))
    finally:
        send.close()


def run_all(items: tuple[Item, ...], rows: list[dict], ctx: Context, echo=print, after_each=None) -> list[dict]:
    """Measure the planned rows in order; each item gets its own range of master ports. `after_each(rows)` runs
    after every item (main writes the report: a check stopped from outside keeps what it measured)."""
    for index, (item, row) in enumerate(zip(items, rows)):
        if row["status"] != "planned":
            continue
        echo(f"[{item.name}] {item.what} (estimate {row['estimate_s']:.0f} s, budget {row['budget_s']:.0f} s) ...",
             flush=True)
        measure_item(item, dataclasses.replace(ctx, port=ctx.port + 50 * index), row)
        said = row["verdict"] or row["reason"]
        echo(f"[{item.name}] {row['status']} in {row['duration_s']:.1f} s" + (f": {said}" if said else ""), flush=True)
        if after_each:
            after_each(rows)
    return rows


def exit_code(rows: list[dict]) -> int:
    statuses = {r["status"] for r in rows}
    if statuses & {"error", "timeout"}:
        return EXIT_ERROR
    return EXIT_MISSED if "missed" in statuses else EXIT_OK


# ============================================================================================ report

def finite(value):
    """`value` with every NaN/inf float replaced by its name as a string: JSON cannot hold them, and a diverged
    loss must not cost the whole report."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def make_report(rows: list[dict], ctx: Context, started: float, finished: float) -> dict:
    import torch
    rows = finite(rows)
    return {"schema": SCHEMA, "started": _iso(started), "finished": _iso(finished),
            "duration_s": round(finished - started, 2), "budget_s": TOTAL_BUDGET_S, "margin": MARGIN,
            "planned_s": round(plan_total(rows), 1), "unit_seconds": items_mod.UNIT_SECONDS, "dry_run": ctx.dry_run,
            "device": ctx.device_name, "gpu_count": ctx.gpu_count, "host": platform.node(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "code": items_mod.code_version(),
            "flash_attention": ctx.flash, "liger": ctx.liger, "ops": list(ctx.ops),
            "exit_code": exit_code(rows), "items": rows, "notes": ctx.notes}


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


def table(report: dict) -> str:
    lines = [f"{'item':<11} {'status':<8} {'time s':>7} {'budget':>6}  verdict / reason"]
    for row in report["items"]:
        said = row["verdict"] or row["reason"]
        lines.append(f"{row['name']:<11} {row['status']:<8} {row['duration_s']:>7.1f} {row['budget_s']:>6.0f}  {said}")
    lines.append(f"total {report['duration_s']:.0f} s (planned {report['planned_s']:.0f} s) of {report['budget_s']} s "
                 f"on {report['device']}" + (" (cpu dry run: nothing measured)" if report["dry_run"] else ""))
    for status, title in (("error", "FAILED"), ("timeout", "TIMED OUT"), ("missed", "goal missed")):
        names = [r["name"] for r in report["items"] if r["status"] == status]
        if names:
            lines.append(f"{title}: {', '.join(names)}")
    return "\n".join(lines)


def write_report(report: dict, output: str) -> Path:
    from trainer.files import finite_json, write_text_atomic
    return write_text_atomic(output, finite_json(report, "-o"), "-o")


# ============================================================================================ main

def main(argv: Optional[list[str]] = None, items: tuple[Item, ...] = ITEMS) -> int:
    args = parse_args(argv)
    if args.worker:
        return items_mod.run_worker(args.worker, args.spec, args.out)
    import tempfile

    import torch

    from trainer.errors import UserError
    from trainer.files import check_target
    why_not = refusal(torch.cuda.is_available(), args.cpu_dry_run)
    if why_not:
        print(why_not, file=sys.stderr)
        return EXIT_USAGE
    try:
        check_target(args.output, "-o")  # before minutes of work, not after
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = machine_context(workdir, args)
    # Stopped from outside (`timeout`, a scheduler): the running item's process tree goes too (isolated's
    # `finally`), and the report already holds every item measured before it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.time()
    rows = plan_all(items, ctx, args)
    print(plan_table(rows, args.budget), flush=True)
    rows = run_all(items, rows, ctx, after_each=lambda done: write_report(make_report(done, ctx, started, time.time()),
                                                                            args.output))
    report = make_report(rows, ctx, started, time.time())
    path = write_report(report, args.output)
    print("\n" + table(report))
    print(f"report: {path} (work directory {workdir})")
    code = report["exit_code"]
    if code == EXIT_ERROR:
        print(f"gpu_check: FAILED items: "
              f"{', '.join(r['name'] for r in rows if r['status'] in ('error', 'timeout'))}", file=sys.stderr)
    return code


def machine_context(workdir: Path, args) -> Context:
    """The GPU, and what the trainer will run on it. A dry run plans for the full stack on an H200 (flash-attn and
    Liger installed), which is what the budgets must fit."""
    import torch

    from trainer.model import flash_attention_available
    ctx = Context(workdir, args.cpu_dry_run, port=args.port)
    if args.cpu_dry_run:
        ctx.flash = ctx.liger = True
        ctx.notes.append("cpu dry run: planned for one H200 with flash-attn and liger-kernel installed")
        return ctx
    ctx.device_name, ctx.gpu_count = torch.cuda.get_device_name(), torch.cuda.device_count()
    ctx.flash, ctx.liger = flash_attention_available(), items_mod.installed("liger_kernel") is not None
    major, minor = torch.cuda.get_device_capability()
    # One architecture, this GPU's: a JIT op compiles once instead of once per architecture torch was built for.
    # Set here, before any item starts, so every item's builds (and their cache) agree.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    return ctx


if __name__ == "__main__":
    sys.exit(main())
