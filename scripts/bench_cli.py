"""Wall time of the light commands (`--help`, presets, show, export, plan, plan --chart, lint, doctor, report,
launch --dry-run, prepare-data --help), this tree against an older commit of it, and which heavy modules each
imported.

    .venv/bin/python scripts/bench_cli.py                       # this tree only
    .venv/bin/python scripts/bench_cli.py --baseline integ      # and that revision, side by side, with ratios
    .venv/bin/python scripts/bench_cli.py --baseline 2b1fe6c --rounds 5

Each command runs in a fresh process (`python -m trainer ...`, the tree on PYTHONPATH and as the working
directory), --rounds times, the trees interleaved round by round so a change in the machine's load hits both
alike; the best (lowest) wall time of each is printed. Both trees share one XDG cache, warmed by one untimed run
first (what a user's second command sees: DeepSpeed's config facts were learned by the first). The last column
says which of torch, deepspeed, datasets, transformers each command left in sys.modules.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "deepspeed", "datasets", "transformers")
PROBE = """
import json, runpy, sys
sys.argv = ["trainer"] + sys.argv[1:]
try:
    runpy.run_module("trainer", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print("\\nLOADED " + json.dumps([m for m in %r if m in sys.modules]), file=sys.stderr)
""" % (HEAVY,)

COMMANDS = {
    "--help": ["--help"],
    "presets": ["presets"],
    "show": ["show", "tiny_cpu"],
    "export": ["export", "tiny_cpu", "-o", "{work}/ds.json"],
    "plan": ["plan", "scenarios/13b_8xa100.yaml"],
    "plan --chart": ["plan", "scenarios/13b_8xa100.yaml", "--chart", "{work}/chart.png"],
    "lint": ["lint", "tiny_cpu"],
    "doctor": ["doctor", "tiny_cpu", "{repo}/tests/logs/cuda_oom.log"],
    "report": ["report", "{work}/run", "-o", "{work}/report.png"],
    "launch --dry-run": ["launch", "tiny_cpu", "--dry-run"],
    "prepare-data --help": ["prepare-data", "--help"],
}


def tree_of(revision: str, workdir: Path) -> Path:
    """The package, presets and scenarios of `revision` (git archive: nothing of this checkout touched)."""
    tree = workdir / f"tree_{revision.replace('/', '_')}"
    data = subprocess.run(["git", "-C", str(REPO), "archive", revision, "trainer", "presets", "scenarios",
                           "train.py"], capture_output=True, check=True).stdout
    tree.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(tree, filter="data")
    return tree


def a_run_dir(work: Path) -> None:
    run = work / "run"
    run.mkdir()
    lines = [{"step": s, "loss": 3.0 - s / 100, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0}
             for s in range(1, 101)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def measure(tree: Path, argv: list[str], env: dict) -> tuple[float, list[str], int]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=tree, env={**env, "PYTHONPATH": str(tree)},
                            capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    line = next((x for x in result.stderr.splitlines() if x.startswith("LOADED ")), "LOADED null")
    return wall, json.loads(line[len("LOADED "):]) or [], result.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git revision to compare with (e.g. integ)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--commands", help="comma-separated names (default: all): " + ", ".join(COMMANDS))
    args = parser.parse_args()
    names = args.commands.split(",") if args.commands else list(COMMANDS)
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        work = Path(tmp)
        a_run_dir(work)
        env = {**os.environ, "XDG_CACHE_HOME": str(work / "xdg")}
        trees = {"this tree": REPO}
        if args.baseline:
            trees[args.baseline] = tree_of(args.baseline, work)
        argvs = {n: [a.format(work=work, repo=REPO) for a in COMMANDS[n]] for n in names}
        for tree in trees.values():  # untimed: learn and cache what is learned once
            measure(tree, argvs.get("show", ["show", "tiny_cpu"]), env)
        best: dict = {}
        for _ in range(args.rounds):
            for name in names:
                for label, tree in trees.items():
                    wall, loaded, code = measure(tree, argvs[name], env)
                    old = best.get((name, label))
                    best[(name, label)] = (min(wall, old[0]) if old else wall, loaded, code)
        header = f"{'command':<22}" + "".join(f"{label[:18]:>20}" for label in trees)
        print(header + (f"{'ratio':>8}" if args.baseline else "") + "   heavy modules loaded (this tree | baseline)")
        for name in names:
            cells = [best[(name, label)] for label in trees]
            row = f"{name:<22}" + "".join(f"{wall:>18.2f} s" + ("!" if code not in (0, 1) else " ")
                                          for wall, _, code in cells)
            if args.baseline:
                row += f"{cells[1][0] / cells[0][0]:>7.1f}x"
            print(row + "   " + " | ".join(",".join(c[1]) or "-" for c in cells))
    print(f"best of {args.rounds} rounds; ratio = baseline / this tree; ! = exit status other than 0 or 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
