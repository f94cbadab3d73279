"""The preflight report as a human table (the JSON is the same dict): ranks, collectives, node pairs, verdict."""
from __future__ import annotations


def render(report: dict) -> str:
    lines = [f"preflight: {report['world_size']} rank(s) on {len(report['nodes'])} node(s), backend "
             f"{report['backend']}, device {report['device']}", ""]
    lines += _table(["rank", "node", "device", "free GB", "total GB", "torch", "deepspeed", "trainer", "config"],
                    [[r["rank"], _node_of(report, r["rank"]), r["device"], f"{r['free_bytes'] / 1e9:.1f}",
                      f"{r['total_bytes'] / 1e9:.1f}", r["versions"]["torch"], r["versions"]["deepspeed"],
                      r["versions"]["trainer"], (r["config_hash"] or "does not resolve")[:12]]
                     for r in report["ranks"]])
    lines += ["", "collectives (nccl-tests' figures: time = slowest rank's, busbw = algbw x 2(n-1)/n all-reduce, "
                  "x (n-1)/n all-gather)"]
    lines += _table(["op", "size", "time us", "algbw GB/s", "busbw GB/s"],
                    [[c["op"], size_text(c["bytes"]), f"{c['time_s'] * 1e6:.1f}", f"{c['algbw_gbps']:.3f}",
                      f"{c['busbw_gbps']:.3f}"] for c in report["collectives"]])
    lines += [""] + _pair_lines(report)
    for heading, items in (("warnings", report["warnings"]), ("problems", report["problems"])):
        if items:
            lines += ["", f"{heading}:"] + [f"  - {item}" for item in items]
    lines += ["", "verdict: ok" if report["verdict"] == "ok" else
              f"verdict: FAIL ({len(report['problems'])} problem(s) above)"]
    return "\n".join(lines)


def _pair_lines(report: dict) -> list[str]:
    pairs = report["node_pairs"]
    if not pairs:
        return ["node pairs: one node, no link between nodes to test"]
    reference = "--expect-busbw" if report["slow_reference"] == "expected" else "the median pair"
    lines = [f"node pairs (all-reduce of {size_text(pairs[0]['bytes'])} between one rank of each node; slow below "
             f"{report['slow_threshold_gbps']:.3f} GB/s = {report['slow_fraction']:g} x {reference})"]
    lines += _table(["nodes", "ranks", "time us", "busbw GB/s", "verdict"],
                    [[f"{p['nodes'][0]} <-> {p['nodes'][1]}", f"{p['ranks'][0]},{p['ranks'][1]}",
                      f"{p['time_s'] * 1e6:.1f}", f"{p['busbw_gbps']:.3f}", "SLOW" if p["slow"] else "ok"]
                     for p in pairs])
    return lines


def size_text(size: int) -> str:
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def _node_of(report: dict, rank: int) -> str:
    return next(n["node"] for n in report["nodes"] if rank in n["ranks"])


def _table(headers: list[str], rows: list[list]) -> list[str]:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
