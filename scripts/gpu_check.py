"""GPU acceptance in one command: MFU, planner vs measured memory, kernels, fp16, inference, the gpu tests.

    .venv/bin/python scripts/gpu_check.py [-o gpu_check.json] [--only ITEM,...] [--skip ITEM,...]
    .venv/bin/python scripts/gpu_check.py --cpu-dry-run -o /tmp/gpu_check.json    # the CPU-checkable parts

Made for one H100/H200-class GPU and at most 8 minutes (TOTAL_BUDGET_S). Each item below has its own budget
(its subprocesses are killed at it; the split is an estimate until a GPU run measures it), prints how long it
took, and ends as one of

  passed    measured, and the goal is met
  missed    measured, and the goal is not met (the numbers are in the report)
  error     it raised, a subprocess failed or ran past the budget: the message names what
  skipped   not run, always with the reason (--skip, --cpu-dry-run, or one GPU for a multi-GPU feature)

Exit code: 0 when nothing errored or missed, 1 when an item errored (named on stderr), 3 when every item ran
but a goal was missed, 2 for bad arguments or when no CUDA GPU is visible (without --cpu-dry-run).

Every item is two steps: `prepare` builds what the measurement needs (synthetic token corpus, the planner's
rows, the exact command lines) and runs on CPU too; `measure` needs the GPU. --cpu-dry-run runs every
`prepare` on tiny sizes and records each `measure` as skipped with that reason: the tests run it
(tests/test_gpu_check.py), so the first GPU minutes go to measuring. The report is one JSON file written
atomically (trainer.files.write_text_atomic); a short table is printed at the end.
"""
from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional


REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [p for p in (str(REPO), str(REPO / "scripts")) if p not in sys.path]

import gpu_check_items as items_mod  # noqa: E402 - scripts/ is not a package: found through the path above


SCHEMA = "gpu_check/1"
TOTAL_BUDGET_S = 480
STATUSES = ("passed", "missed", "error", "skipped")
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_MISSED = 0, 1, 2, 3


@dataclass(frozen=True)
class Item:
    name: str
    budget_s: float
    what: str
    goal: str
    prepare: Callable  # (ctx) -> dict: CPU-checkable
    measure: Callable  # (ctx, prepared, deadline) -> (status, measurements, verdict); GPU only


ITEMS: tuple[Item, ...] = (
    Item("preflight", 45, "CUDA device, torch/CUDA, flash-attn, liger-kernel; DeepSpeed's fused Adam built (JIT, "
         "cached) here, so the timed items do not pay for it", "every GPU dependency importable", items_mod.prepare_preflight, items_mod.measure_preflight),
    Item("throughput", 160, "1B Llama (1b_pretrain_8xh100 shape), 1 GPU, bf16, seq 4096, synthetic tokens: "
         "sdpa / flash-attn 2 / flash-attn 2 + Liger, and minimal DeepSpeed loop and HF Trainer (scripts/bench.py)",
         ">= 50% MFU with flash-attn + Liger; loop >= 0.99x minimal; >= 1.05x HF Trainer",
         items_mod.prepare_throughput, items_mod.measure_throughput),
    Item("memory", 80, "torch.cuda.max_memory_allocated vs the planner's per-GPU total, 4 configurations",
         "every row within 10%", items_mod.prepare_memory, items_mod.measure_memory),
    Item("kernels", 25, "flash-attn and Liger by what executed: attention implementation, module types, "
         "profiler kernel names", "flash_attn's own kernels and Liger's kernels in the trace",
         items_mod.prepare_kernels, items_mod.measure_kernels),
    Item("fp16", 25, "fp16 with dynamic loss scaling (7b_2xv100's fp16 block, ZeRO-3), tiny model",
         "loss scale logged on every step, loss falls", items_mod.prepare_fp16, items_mod.measure_fp16),
    Item("zeropp", 15, "ZeRO++ quantized weights (zero_quantized_weights) on the GPUs present",
         "trains, loss falls", items_mod.prepare_zeropp, items_mod.measure_zeropp),
    Item("inference", 40, "`trainer generate` tokens/s with and without kernel injection, next to transformers "
         "generate (scripts/bench_generate.py)", "trainer >= 0.95x transformers without injection",
         items_mod.prepare_inference, items_mod.measure_inference),
    Item("gpu_tests", 90, "pytest -m gpu tests/test_gpu.py", "all pass, none skipped",
         items_mod.prepare_gpu_tests, items_mod.measure_gpu_tests),
)


@dataclass
class Context:
    """What every item sees: the work directory, the dry-run flag and the sizes that follow from it."""
    workdir: Path
    dry_run: bool
    port: int = 30500
    device_name: str = "cpu"
    gpu_count: int = 0
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


# ============================================================================================ running

def selected(item: Item, args) -> Optional[str]:
    """Why `item` is not run (a skip reason), or None."""
    if args.only and item.name not in args.only:
        return f"not in --only {','.join(args.only)}"
    if item.name in args.skip:
        return "--skip on the command line"
    return None


def run_item(item: Item, ctx: Context, skip_reason: Optional[str], clock=time.monotonic) -> dict:
    """One item: prepare, then measure (or skip with the reason); never raises."""
    row = {"name": item.name, "what": item.what, "goal": item.goal, "budget_s": item.budget_s, "status": "skipped",
           "duration_s": 0.0, "measurements": {}, "verdict": "", "reason": skip_reason or ""}
    if skip_reason:
        return row
    started = clock()
    deadline = started + item.budget_s
    stage = "prepare"
    try:
        prepared = item.prepare(ctx)
        row["measurements"]["prepared"] = prepared
        if ctx.dry_run:
            row["reason"] = "--cpu-dry-run: the measurement needs a CUDA GPU (prepared part checked)"
        else:
            stage = "measure"
            status, measurements, verdict = item.measure(ctx, prepared, deadline)
            if status not in STATUSES:
                raise RuntimeError(f"returned unknown status {status!r}")
            row.update(status=status, verdict=verdict)
            row["measurements"].update(measurements)
            if status == "skipped":
                row["reason"] = verdict
    except Exception as err:  # any failure becomes this item's error, named; the other items still run
        row.update(status="error", verdict=f"{stage} failed: {type(err).__name__}: {err}",
                   traceback=traceback.format_exc(limit=8))
        row["measurements"].update(getattr(err, "measurements", {}))  # what a partly failed item did measure
    row["duration_s"] = round(clock() - started, 2)
    if row["duration_s"] > item.budget_s and row["status"] != "error":
        row.update(status="error", verdict=f"took {row['duration_s']:.0f} s, over its {item.budget_s:.0f} s budget "
                                           f"(was: {row['verdict'] or row['status']})")
    return row


def run_all(items: tuple[Item, ...], ctx: Context, args, echo=print) -> list[dict]:
    rows = []
    for item in items:
        echo(f"[{item.name}] {item.what} (budget {item.budget_s:.0f} s) ...", flush=True)
        row = run_item(item, ctx, selected(item, args))
        rows.append(row)
        said = row["verdict"] or row["reason"]
        echo(f"[{item.name}] {row['status']} in {row['duration_s']:.1f} s" + (f": {said}" if said else ""), flush=True)
    return rows


def exit_code(rows: list[dict]) -> int:
    statuses = {r["status"] for r in rows}
    if "error" in statuses:
        return EXIT_ERROR
    return EXIT_MISSED if "missed" in statuses else EXIT_OK


def budget_check(items: tuple[Item, ...] = ITEMS, total: float = TOTAL_BUDGET_S) -> float:
    """The items' budgets together; they must fit the whole check's budget."""
    spent = sum(i.budget_s for i in items)
    if spent > total:
        raise AssertionError(f"item budgets add up to {spent} s, over the {total} s budget")
    return spent


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
            "duration_s": round(finished - started, 2), "budget_s": TOTAL_BUDGET_S, "dry_run": ctx.dry_run,
            "device": ctx.device_name, "gpu_count": ctx.gpu_count, "host": platform.node(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "code": items_mod.code_version(),
            "exit_code": exit_code(rows), "items": rows, "notes": ctx.notes}


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


def table(report: dict) -> str:
    lines = [f"{'item':<11} {'status':<8} {'time s':>7} {'budget':>6}  verdict / reason"]
    for row in report["items"]:
        said = row["verdict"] or row["reason"]
        lines.append(f"{row['name']:<11} {row['status']:<8} {row['duration_s']:>7.1f} {row['budget_s']:>6.0f}  {said}")
    lines.append(f"total {report['duration_s']:.0f} s of {report['budget_s']} s on {report['device']}"
                 + (" (cpu dry run: nothing measured)" if report["dry_run"] else ""))
    failed = [r["name"] for r in report["items"] if r["status"] == "error"]
    if failed:
        lines.append(f"FAILED: {', '.join(failed)}")
    missed = [r["name"] for r in report["items"] if r["status"] == "missed"]
    if missed:
        lines.append(f"goal missed: {', '.join(missed)}")
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
    ctx = Context(workdir, args.cpu_dry_run, port=args.port)
    if torch.cuda.is_available():
        ctx.device_name, ctx.gpu_count = torch.cuda.get_device_name(), torch.cuda.device_count()
    started = time.time()
    rows = run_all(items, ctx, args)
    report = make_report(rows, ctx, started, time.time())
    path = write_report(report, args.output)
    print("\n" + table(report))
    print(f"report: {path} (work directory {workdir})")
    code = report["exit_code"]
    if code == EXIT_ERROR:
        print(f"gpu_check: FAILED items: {', '.join(r['name'] for r in rows if r['status'] == 'error')}",
              file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
