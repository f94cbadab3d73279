"""Run fuzzed command lines through `trainer.__main__.main`, one after another in this process, and report each.

    python tests/workers/fuzz_cli.py CASES.json REPORT.json SANDBOX

CASES: [{"argv": [...]}, ...]. For each case the report holds the exit code, whether a traceback reached stderr or
an exception escaped `main`, whether it ran past its time limit, the files it created or changed in SANDBOX
(outside SANDBOX/cache), and the tail of its stderr. A case that hangs is stopped by SIGALRM and reported.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import traceback
from pathlib import Path

CASE_LIMIT_S = 90
# A case of a command that imports DeepSpeed and starts a process group does so in its own time (the light commands
# before it no longer import DeepSpeed for it): on 2 loaded cores that alone can take a minute
DEEPSPEED_COMMANDS, DEEPSPEED_CASE_LIMIT_S = ("train", "preflight", "autotune", "generate", "evaluate"), 180


class Hung(BaseException):
    """Raised by SIGALRM in a case that ran past its limit (a BaseException: no `except Exception` swallows it)."""


def _hung(signum, frame):
    raise Hung()


def tree(root: Path) -> dict[str, tuple]:
    """Every file under root (not cache/) with its size and mtime: what a case may not change when it fails."""
    out = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if relative.parts and relative.parts[0] == "cache":
            continue
        try:
            info = path.lstat()
        except OSError:
            continue
        out[str(relative)] = (info.st_size, info.st_mtime_ns) if path.is_file() else ("dir" if path.is_dir() else "other")
    return out


def run_case(argv: list[str], sandbox: Path) -> dict:
    from trainer.__main__ import main
    before = tree(sandbox)
    err, out = io.StringIO(), io.StringIO()
    result = {"argv": argv, "hung": False, "escaped": None}
    signal.alarm(DEEPSPEED_CASE_LIMIT_S if argv[:1] and argv[0] in DEEPSPEED_COMMANDS else CASE_LIMIT_S)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            result["code"] = main(list(argv))
    except Hung:
        result.update(code=None, hung=True)
    except SystemExit as stop:  # main returns its codes; SystemExit escaping it is a bug too
        result.update(code=stop.code, escaped=f"SystemExit({stop.code!r})")
    except BaseException as exc:  # noqa: BLE001 - the point is to see every escape
        result.update(code=None, escaped="".join(traceback.format_exception_only(type(exc), exc)).strip()[-500:])
    finally:
        signal.alarm(0)
    after = tree(sandbox)
    result["changed"] = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    text = err.getvalue()
    result["traceback"] = "Traceback (most recent call last)" in text
    result["stderr"] = text[-1500:]
    return result


def main() -> int:
    cases_file, report_file, sandbox = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    signal.signal(signal.SIGALRM, _hung)
    (sandbox / "cwd").mkdir(exist_ok=True)
    os.chdir(sandbox / "cwd")  # relative outputs land in the sandbox, where the test sees them
    # Every command's module (torch, datasets among their imports) once before the clock, as `main` imported them
    # all before it ran only the chosen one: a case's limit is for its work, not for the imports of this process
    from trainer.__main__ import build_parser
    build_parser()
    report = []
    for case in json.loads(Path(cases_file).read_text()):
        report.append(run_case(case["argv"], sandbox))
        Path(report_file).write_text(json.dumps(report))  # written as it goes: a crash keeps what was seen
    return 0


if __name__ == "__main__":
    sys.exit(main())
