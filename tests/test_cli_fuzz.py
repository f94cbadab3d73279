"""A fuzz test of the whole command line (issue: hardening round 2): every subcommand, random flags taken from its
own parser, hostile values. Whatever the input: no traceback and nothing escaping `main`, an exit code in
{0, 1, 2, 3, 130}, no command injected by a value ever runs, and a command that fails leaves the files it was
pointed at as they were.

The cases are drawn from the parsers (a flag added tomorrow is fuzzed too) with a fixed seed, so a failure is
reproduced by its printed command line. `launch` always gets --dry-run (a real launch would start training).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys

import pytest

from distributed import REPO
from trainer import numbers, paths
from trainer.__main__ import build_parser, subcommands

# Every test reads the fuzz run (every command x its drawn cases, in a subprocess: ~20 s here): slow, not quick.
pytestmark = pytest.mark.slow

SEED = 23
CASES_PER_COMMAND = 14
ALLOWED_CODES = {0, 1, 2, 3, 130}
PAYLOAD_MARKERS = ("PWNED_SUBSHELL", "PWNED_BACKTICK", "PWNED_SEMICOLON", "PWNED_PROXY", "PWNED_NEWLINE")


def hostile_values(sandbox: str) -> list[str]:
    numbers = ["nan", "inf", "-inf", "-1", "0", "1e30", "1e400", "99999999999999999999999", "2.5", "", " ", "ten",
               "0x10", "1_000", "-0"]
    paths = [f"{sandbox}/file.txt", f"{sandbox}/dir", f"{sandbox}/fifo", "/dev/full", "/dev/null",
             f"{sandbox}/missing/x.png", f"{sandbox}/file.txt/x", "../../../../etc/passwd", f"{sandbox}/out/o.json",
             f"{sandbox}/data.jsonl", f"{sandbox}/latin1.jsonl", "."]
    injections = [f"$(touch {sandbox}/PWNED_SUBSHELL)", f"`touch {sandbox}/PWNED_BACKTICK`",
                  f"x;touch {sandbox}/PWNED_SEMICOLON", f"-oProxyCommand=touch {sandbox}/PWNED_PROXY",
                  f"a\ntouch {sandbox}/PWNED_NEWLINE", "--", "-", "--help=x"]
    odd = ["x" * 5000, "é✓ ünïcode", "\udcff\udcfe", "train.lr=1e-3", "train={lr: 1}", "deepspeed.x:={}", "tiny_cpu",
           "7b", "a100-80g", "auto", "off", "null", "{", "[1, 2", "*"]
    return numbers + paths + injections + odd


def plausible(action: argparse.Action, sandbox: str, rng: random.Random) -> str:
    """A value the flag could take (so one hostile value in a case reaches the code behind the parser)."""
    kind = action.type
    if action.choices:
        return str(rng.choice(list(action.choices)))
    if isinstance(kind, numbers.Kind):
        low = kind.low + (1 if kind.low_open else 0)
        high = kind.high if kind.high is not None else low + 10
        return str(int(min(high, low + rng.randint(0, 3))) if kind.integer else min(high, low + rng.random()))
    if isinstance(kind, paths.PathKind):
        if kind.role == "input":
            return f"{sandbox}/data.jsonl" if kind.want == "file" else f"{sandbox}/dir"
        suffix = kind.suffixes[0] if kind.suffixes else ".out"
        return f"{sandbox}/out/made{rng.randint(0, 9)}{suffix}" if kind.want == "file" else f"{sandbox}/out/newdir"
    return rng.choice(["tiny_cpu", "7b", "auto", f"{sandbox}/data.jsonl", "train.lr=0.001"])


def draw_cases(sandbox: str) -> list[list[str]]:
    """Per command: half the cases all hostile, half plausible but for one hostile value."""
    rng = random.Random(SEED)
    values = hostile_values(sandbox)
    parser, _ = build_parser()
    cases = []
    for command, sub in subcommands(parser).items():
        flags = [a for a in sub._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
                 and a.help != argparse.SUPPRESS and a.dest != "dry_run"]
        positionals = [a for a in sub._actions if not a.option_strings]
        for number in range(CASES_PER_COMMAND):
            chosen = [(a, 1 if a.nargs in (None, "?") else a.nargs if isinstance(a.nargs, int) else rng.randint(1, 2))
                      for a in positionals if not (a.nargs == "?" and rng.random() < 0.3)]
            chosen += [(a, a.nargs if isinstance(a.nargs, int) else 1)
                       for a in rng.sample(flags, min(len(flags), rng.randint(1, 4)))]
            hostile = rng.randrange(len(chosen)) if number % 2 and chosen else None
            argv = [command]
            for index, (action, count) in enumerate(chosen):
                words = [(rng.choice(values) if hostile is None or index == hostile else plausible(action, sandbox, rng))
                         for _ in range(count)]
                argv += ([action.option_strings[0]] if action.option_strings else []) + words
            if command == "launch":
                argv.append("--dry-run")
            cases.append(argv)
    return cases


@pytest.fixture(scope="module")
def fuzz_report(tmp_path_factory):
    sandbox = tmp_path_factory.mktemp("fuzz")
    (sandbox / "file.txt").write_text("not a config\n")
    (sandbox / "dir").mkdir()
    (sandbox / "out").mkdir()
    os.mkfifo(sandbox / "fifo")
    (sandbox / "data.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(20)))
    (sandbox / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    cases = draw_cases(str(sandbox))
    spec, report = sandbox / "cases.json", sandbox / "report.json"
    spec.write_text(json.dumps([{"argv": argv} for argv in cases]))
    from trainer.jit_locks import extensions_root
    env = {**os.environ, "XDG_CACHE_HOME": str(sandbox / "cache"), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
           "TORCH_EXTENSIONS_DIR": str(extensions_root())}  # the built ops (XDG_CACHE_HOME would move them)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "tests/workers/fuzz_cli.py", str(spec), str(report), str(sandbox)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=3000, errors="replace")
    results = json.loads(report.read_text()) if report.exists() else []
    assert proc.returncode == 0 and len(results) == len(cases), proc.stderr[-4000:]
    return sandbox, results


def described(case: dict) -> str:
    return f"{shlex.join(['python', '-m', 'trainer', *case['argv']])[:600]}\n  -> {case['code']}: " \
           f"{case['stderr'][-600:]}"


def test_the_fuzz_covers_every_command(fuzz_report):
    _, results = fuzz_report
    parser, _ = build_parser()
    assert {r["argv"][0] for r in results} == set(subcommands(parser))
    assert len(results) >= 14 * CASES_PER_COMMAND


def test_no_traceback_and_nothing_escapes(fuzz_report):
    _, results = fuzz_report
    bad = [described(r) for r in results if r["traceback"] or r["escaped"] or r["hung"]]
    assert not bad, f"{len(bad)} case(s):\n" + "\n".join(bad[:8])


def test_exit_codes_are_the_documented_ones(fuzz_report):
    _, results = fuzz_report
    bad = [described(r) for r in results if r["code"] not in ALLOWED_CODES]
    assert not bad, "\n".join(bad[:8])


def test_no_injected_command_runs(fuzz_report):
    sandbox, _ = fuzz_report
    assert not [m for m in PAYLOAD_MARKERS if (sandbox / m).exists()]


def test_a_refused_command_changes_no_file(fuzz_report):
    """Exit 2 (bad input) and 130 (interrupted) leave every file as it was. Exit 1 is a negative answer (preflight's
    checks failed, plan fits nowhere, the doctor recognises nothing), whose report is still written."""
    _, results = fuzz_report
    bad = [f"{described(r)}\n  changed: {r['changed']}" for r in results if r["code"] in (2, 130) and r["changed"]]
    assert not bad, "\n".join(bad[:8])
