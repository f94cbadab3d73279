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
        found.append({"file": f"{module}.py", "name": case.get("name"), "time": float(case.get("time") or 0),
                      "outcome": outcome})
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a pytest --junitxml file")
    parser.add_argument("--top", type=int, default=50, help="how many of the slowest tests to list")
    parser.add_argument("--markdown", action="store_true", help="markdown tables (for docs/tests.md)")
    parser.add_argument("--write", metavar="JSON", help="save {module file: seconds} (tests/durations.json)")
    args = parser.parse_args()
    found = cases(args.report)
    total = sum(c["time"] for c in found)
    by_file: dict[str, list[float]] = defaultdict(list)
    for case in found:
        by_file[case["file"]].append(case["time"])
    rows = sorted(by_file.items(), key=lambda item: -sum(item[1]))
    if args.write:
        with open(args.write, "w") as out:
            json.dump({name: round(sum(times), 1) for name, times in rows}, out, indent=1)
            out.write("\n")
    bar = "|" if args.markdown else ""
    print(f"{len(found)} tests, {total / 60:.1f} min in tests (setup + call + teardown)")
    print()
    print(f"{bar} file {bar} tests {bar} seconds {bar} share {bar}" if args.markdown else "file  tests  seconds  share")
    if args.markdown:
        print("|---|---:|---:|---:|")
    for name, times in rows:
        line = [name, str(len(times)), f"{sum(times):.0f}", f"{100 * sum(times) / total:.1f}%"]
        print(f"| {' | '.join(line)} |" if args.markdown else "  ".join(line))
    print()
    slowest = sorted(found, key=lambda c: -c["time"])[:args.top]
    print(f"{bar} test {bar} seconds {bar}" if args.markdown else "slowest tests")
    if args.markdown:
        print("|---|---:|")
    for case in slowest:
        name = f"{case['file']}::{case['name']}"
        print(f"| `{name}` | {case['time']:.1f} |" if args.markdown else f"{case['time']:7.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
