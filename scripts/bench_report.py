"""Time and peak memory of `python -m trainer report` on hostile and huge metrics files, this tree against an
older commit of it.

    .venv/bin/python scripts/bench_report.py                        # this tree only
    .venv/bin/python scripts/bench_report.py --baseline 7928f52     # and that commit, side by side, with ratios
    .venv/bin/python scripts/bench_report.py --cases resumes --timeout 300

Files, written once to --workdir (seeded, so every run of the script reads the same bytes):

  tiny        two train lines: the floor of any `python -m trainer` command (its imports, torch among them;
              ~380 MB and ~5 s of CPU here), which every other case includes
  resumes     a 1,000-step run whose metrics.jsonl then holds --resumes resume events (each at a random earlier
              step, as a crash loop restarting from random checkpoints would leave): ~14 MB for 300,000
  long        a --steps-step run (the trainer's train line at every step, an eval line every 1,000 steps,
              a resume every 50,000): ~230 MB for 1,000,000 steps
  one_line    --one-line-mb MB of digits with no newline (a file that is one torn line)

Each report runs in a fresh process (`python -m trainer report FILE -o OUT.png`, the tree on PYTHONPATH);
its wall time, its CPU time (user + system) and its own peak RSS (os.wait4's rusage: the child alone) are printed,
and the exit status: a run past --timeout is killed and shown as `>T` (its ratios are then lower bounds, marked
+). On a shared machine wall time depends on the load; CPU time much less so: compare the two trees by it.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN_STEPS_BEFORE_RESUMES = 1000


def train_line(step: int, rng: random.Random) -> str:
    loss = 10.0 / (1 + step / 500) + rng.random() * 0.1
    return json.dumps({"step": step, "loss": loss, "lr": 3e-4 * min(1.0, step / 2000), "grad_norm": 1 + rng.random(),
                       "tokens_per_s": 41000 + rng.random() * 900, "step_time_s": 0.1 + rng.random() * 0.01,
                       "tflops_per_gpu": 120 + rng.random(), "mfu": 0.41 + rng.random() * 0.01,
                       "peak_mem_gb": 61.2 + rng.random() * 0.01})


def resume_line(step: int) -> str:
    return json.dumps({"step": step, "event": "resume", "checkpoint": f"step_{step:08d}", "world_size": 2},
                      separators=(",", ":"))


def write_resumes(path: Path, resumes: int) -> None:
    rng = random.Random(1)
    with open(path, "w") as out:
        for step in range(1, TRAIN_STEPS_BEFORE_RESUMES + 1):
            out.write(train_line(step, rng) + "\n")
        for _ in range(resumes):
            out.write(resume_line(rng.randrange(1, TRAIN_STEPS_BEFORE_RESUMES)) + "\n")


def write_tiny(path: Path, lines: int) -> None:
    rng = random.Random(0)
    path.write_text("".join(train_line(step, rng) + "\n" for step in range(1, lines + 1)))


def write_long(path: Path, steps: int) -> None:
    rng = random.Random(2)
    with open(path, "w") as out:
        for step in range(1, steps + 1):
            out.write(train_line(step, rng) + "\n")
            if step % 1000 == 0:
                out.write(json.dumps({"step": step, "eval_loss": 10.0 / (1 + step / 500), "eval_ppl": 2.0}) + "\n")
            if step % 50_000 == 0:
                out.write(resume_line(step) + "\n")


def write_one_line(path: Path, megabytes: int) -> None:
    with open(path, "w") as out:
        out.write('{"step": 1, "loss": ')
        for _ in range(megabytes):
            out.write("7" * (1 << 20))


def make_files(workdir: Path, args) -> dict[str, Path]:
    makers = {"tiny": (write_tiny, 2), "resumes": (write_resumes, args.resumes), "long": (write_long, args.steps),
              "one_line": (write_one_line, args.one_line_mb)}
    files = {}
    for case in args.cases:
        maker, size = makers[case]
        directory = workdir / "runs" / f"{case}_{size}"
        directory.mkdir(parents=True, exist_ok=True)
        file = directory / "metrics.jsonl"
        if not file.exists():
            started = time.perf_counter()
            maker(file.with_suffix(".tmp"), size)
            file.with_suffix(".tmp").rename(file)
            print(f"wrote {file} ({file.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - started:.0f} s)",
                  file=sys.stderr)
        files[case] = file
    return files


def checkout(workdir: Path, revision: str) -> Path:
    """The trainer package of `revision` (git archive: no worktree, nothing of this checkout touched)."""
    tree = workdir / f"tree_{revision}"
    if not (tree / "trainer").is_dir():
        data = subprocess.run(["git", "-C", str(REPO), "archive", revision, "trainer"], capture_output=True,
                              check=True).stdout
        tree.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            archive.extractall(tree, filter="data")
    return tree


def measure(tree: Path, file: Path, out: Path, timeout: float) -> dict:
    """One report in a fresh process: wall seconds, the child's peak RSS, its exit status and last stderr line."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "report", str(file), "-o", str(out)], cwd=tree,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    killed = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() - started > timeout and not killed:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    stderr = proc.stderr.read().decode("utf-8", "replace").strip().splitlines()
    return {"seconds": seconds, "cpu_s": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024,
            "rc": proc.returncode, "killed": killed, "said": stderr[-1][:110] if stderr else ""}


def shown(result: dict, timeout: float) -> str:
    wall = f">{timeout:.0f}" if result["killed"] else f"{result['seconds']:.1f}"
    return f"{wall:>8} s wall {result['cpu_s']:>7.1f} s CPU {result['rss_mb']:>7.0f} MB rc={result['rc']}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a git revision of this repository to compare against (e.g. 7928f52)")
    parser.add_argument("--cases", nargs="+", default=["tiny", "resumes", "long", "one_line"],
                        choices=["tiny", "resumes", "long", "one_line"])
    parser.add_argument("--resumes", type=int, default=300_000)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--one-line-mb", type=int, default=100)
    parser.add_argument("--baseline-only", action="store_true", help="measure only the --baseline revision")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a report is killed")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_report"))
    args = parser.parse_args()
    files = make_files(args.workdir, args)
    trees = {"this tree": REPO}
    if args.baseline:
        trees = {args.baseline: checkout(args.workdir, args.baseline), **({} if args.baseline_only else trees)}
    results: dict[str, dict[str, dict]] = {}
    for case, file in files.items():
        for name, tree in trees.items():
            out = args.workdir / f"{case}_{name.replace(' ', '_')}.png"
            results.setdefault(case, {})[name] = result = measure(tree, file, out, args.timeout)
            print(f"{case:>9} {file.stat().st_size / 1e6:7.1f} MB  {name:>10}: {shown(result, args.timeout)}  "
                  f"{result['said']}", flush=True)
    if args.baseline and not args.baseline_only:
        print(f"\n{'case':>9} {'wall ' + args.baseline:>14} {'now':>8} {'ratio':>7}  {'CPU ' + args.baseline:>13} "
              f"{'now':>8} {'ratio':>7}  {'RSS ' + args.baseline:>13} {'now':>8} {'ratio':>7}")
        for case, by_tree in results.items():
            old, new = by_tree[args.baseline], by_tree["this tree"]
            more = "+" if old["killed"] else " "  # killed: the old one would have taken longer still
            cells = [f"{case:>9}"]
            for key, unit in (("seconds", "s"), ("cpu_s", "s"), ("rss_mb", "MB")):
                shown_old = f"{'>' if old['killed'] else ''}{old[key]:.1f} {unit}"
                cells.append(f"{shown_old:>14} {new[key]:>6.1f} {unit} {old[key] / new[key]:>6.1f}x{more}")
            print(" ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
