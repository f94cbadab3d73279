"""Where the suite's time goes: per file, per tier, and the slowest tests, from a pytest JUnit XML report.

    .venv/bin/python -m pytest -q tests --junitxml=/tmp/suite.xml
    .venv/bin/python scripts/test_durations.py /tmp/suite.xml [--top 50] [--markdown] [--write tests/durations.json]

A test's time is its setup + call + teardown (pytest's default for JUnit), so a module or session fixture's launch
is counted on the first test that needs it. `docs/tests.md`'s table is this script's --markdown output; --write
saves the seconds per module that tests/conftest.py orders the modules by (longest first, so two xdist workers that
each take whole modules end together).
"""
from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict


def cases(path: str) -> list[dict]:
    found = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        module = case.get("classname", "").split(".")[-1] or "?"
        cpu = [float(p.get("value")) for p in case.iter("property") if p.get("name") == "cpu_s"]
        found.append({"file": f"{module}.py", "name": case.get("name"), "time": float(case.get("time") or 0),
                      "cpu": cpu[0] if cpu else None, "outcome": outcome})
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a pytest --junitxml file")
    parser.add_argument("--top", type=int, default=50, help="how many of the slowest tests to list")
    parser.add_argument("--markdown", action="store_true", help="markdown tables (for docs/tests.md)")
    parser.add_argument("--write", metavar="JSON", help="save {module file: seconds} (tests/durations.json)")
    args = parser.parse_args()
    found = cases(args.report)
    with_cpu = all(case["cpu"] is not None for case in found) and bool(found)
    cost = "cpu" if with_cpu else "time"  # CPU seconds when recorded (TRAINER_TEST_CPU=1): the suite is CPU-bound
    total = sum(c["time"] for c in found)
    by_file: dict[str, list[dict]] = defaultdict(list)
    for case in found:
        by_file[case["file"]].append(case)
    rows = sorted(by_file.items(), key=lambda item: -sum(c[cost] for c in item[1]))
    if args.write:
        with open(args.write, "w") as out:
            json.dump({name: round(sum(c["time"] for c in cases_), 1) for name, cases_ in rows}, out, indent=1)
            out.write("\n")
    bar = "|" if args.markdown else ""
    print(f"{len(found)} tests, {total / 60:.1f} min in tests (setup + call + teardown)"
          + (f", {sum(c['cpu'] for c in found) / 60:.1f} CPU-min" if with_cpu else ""))
    print()
    columns = ["file", "tests", "seconds", *(["CPU s"] if with_cpu else []), "share"]
    print(f"{bar} {f' {bar} '.join(columns)} {bar}" if args.markdown else "  ".join(columns))
    if args.markdown:
        print("|---|" + "---:|" * (len(columns) - 1))
    whole = sum(c[cost] for c in found) or 1.0
    for name, cases_ in rows:
        line = [name, str(len(cases_)), f"{sum(c['time'] for c in cases_):.0f}",
                *([f"{sum(c['cpu'] for c in cases_):.0f}"] if with_cpu else []),
                f"{100 * sum(c[cost] for c in cases_) / whole:.1f}%"]
        print(f"| {' | '.join(line)} |" if args.markdown else "  ".join(line))
    print()
    slowest = sorted(found, key=lambda c: -c[cost])[:args.top]
    print((f"{bar} test {bar} seconds {bar}" + (" CPU s |" if with_cpu and args.markdown else ""))
          if args.markdown else "slowest tests" + (" (by CPU: seconds, CPU s)" if with_cpu else ""))
    if args.markdown:
        print("|---|---:|" + ("---:|" if with_cpu else ""))
    for case in slowest:
        name = f"{case['file']}::{case['name']}"
        cpu = f"{case['cpu']:.1f}" if with_cpu else ""
        if args.markdown:
            print(f"| `{name}` | {case['time']:.1f} |" + (f" {cpu} |" if with_cpu else ""))
        else:
            print(f"{case['time']:7.1f}  " + (f"{cpu:>7}  " if with_cpu else "") + name)
    return 0

if __name__ == "__main__":
    sys.exit(main())
