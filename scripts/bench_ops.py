"""Do environments and ninjas rebuild each other's DeepSpeed ops? Before (torch's shared default directory, the
ninja PATH finds first) and after (trainer/jit_env.py: a directory and a ninja per environment), side by side.

    .venv/bin/python scripts/bench_ops.py                   # everything under /tmp/bench_ops, deleted after
    .venv/bin/python scripts/bench_ops.py --keep --op CPUAdamBuilder

Each step is a fresh process that loads one op (--op, DeepSpeed's shared-memory all-reduce by default: the op
every CPU launch of 2+ ranks loads) and reports its seconds and whether the op's .so was rebuilt:

1 environments  this virtualenv (A) and a second one (B, as a second checkout's .venv: its own copy of DeepSpeed,
                its own ninja, this one's other packages through a .pth file), loading in turn A, B, A, B.
                before: both in one directory (torch's default, as TORCH_EXTENSIONS_DIR); after: `import trainer`
                first, which gives each its own.
2 ninjas        this virtualenv, activated (its bin/ first on PATH: its ninja) and not (Debian's /usr/bin/ninja
                first), in turn: activated, not, activated. before: no trainer; after: `import trainer` first.

Builds go to --workdir only (XDG_CACHE_HOME points there): nothing in ~/.cache is touched. Expect several
minutes per build on a 2-core machine; the table prints the builds each scenario cost.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROBE = r"""
import json, os, shutil, sys, time
if sys.argv[1] == "trainer":
    import trainer  # this environment's directory and ninja
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder(sys.argv[2])
library = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], builder.name, builder.name + ".so")
before = os.path.getmtime(library) if os.path.exists(library) else None
started = time.time()
builder.load(verbose=False)
print(json.dumps({"seconds": time.time() - started, "built": os.path.getmtime(library) != before,
                  "root": os.environ["TORCH_EXTENSIONS_DIR"], "ninja": shutil.which("ninja")}))
"""


def second_environment(workdir: Path) -> Path:
    """A virtualenv with its own DeepSpeed sources and ninja, this one's other packages (no download)."""
    env = workdir / "checkout-b" / ".venv"
    if not (env / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    asked = subprocess.run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                            "['purelib'])"], capture_output=True, text=True, check=True)
    purelib = Path(asked.stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    if not (purelib / "deepspeed").exists():
        shutil.copytree(ours / "deepspeed", purelib / "deepspeed", symlinks=True)
    (purelib / "checkout_a_packages.pth").write_text(f"{ours}\n")
    ninja = Path(sysconfig.get_path("scripts")) / "ninja"
    if ninja.exists() and not (env / "bin" / "ninja").exists():
        shutil.copy2(ninja, env / "bin" / "ninja")
    return env


def probe(python: Path, mode: str, op: str, env: dict) -> dict:
    proc = subprocess.run([str(python), "-c", PROBE, mode, op], cwd="/", env=env, capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"probe failed ({python}, {mode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def clean_env(workdir: Path, path: str, shared: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "TRAINER_EXTENSIONS_DIR_FOR",
                                                           "VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PATH=path, XDG_CACHE_HOME=str(workdir / "cache"), PYTHONPATH=str(REPO))
    if shared is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(shared)
    return env


def run(label: str, steps: list[tuple[str, Path, str, dict]], op: str) -> list[dict]:
    rows = []
    for name, python, mode, env in steps:
        result = probe(python, mode, op, env)
        rows.append({"scenario": label, "step": name, **result})
        print(f"  {label:<22} {name:<16} {result['seconds']:7.1f} s  {'BUILT' if result['built'] else 'loaded':<6}  "
              f"ninja {result['ninja']}  in {result['root']}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/bench_ops")
    parser.add_argument("--op", default="ShareMemCommBuilder", help="DeepSpeed op builder class (CPU accelerator)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--only", choices=("environments", "ninjas"))
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    a = Path(sys.executable)
    a_bin = str(Path(sysconfig.get_path("scripts")))
    plain = "/usr/local/bin:/usr/bin:/bin"  # a shell without the virtualenv (Debian's ninja, if installed)
    rows: list[dict] = []
    try:
        if args.only in (None, "environments"):
            b = second_environment(workdir) / "bin" / "python"
            b_bin = str(b.parent)
            for label, mode, shared in (("environments, before", "plain", workdir / "shared"),
                                        ("environments, after", "trainer", None)):
                steps = [(f"{which} #{n}", py, mode, clean_env(workdir, f"{bindir}:{plain}", shared))
                         for n, (which, py, bindir) in enumerate([("A", a, a_bin), ("B", b, b_bin),
                                                                   ("A", a, a_bin), ("B", b, b_bin)], 1)]
                rows += run(label, steps, args.op)
        if args.only in (None, "ninjas"):
            for label, mode, shared in (("ninjas, before", "plain", workdir / "shared-ninjas"),
                                        ("ninjas, after", "trainer", None)):
                steps = [(name, a, mode, clean_env(workdir, path, shared)) for name, path in
                         (("activated #1", f"{a_bin}:{plain}"), ("not activated", plain),
                          ("activated #2", f"{a_bin}:{plain}"))]
                rows += run(label, steps, args.op)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print("\nscenario                 builds  total s   (the first build of each environment is unavoidable)")
    for label in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == label]
        print(f"  {label:<22} {sum(r['built'] for r in mine):>5}  {sum(r['seconds'] for r in mine):8.1f}")
    (Path("/tmp") / "bench_ops.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
