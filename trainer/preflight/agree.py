"""What every rank must share: the software versions and the resolved preset. Pure functions over the facts
each rank reports, so a mismatch is named (which ranks, which value, which config key) rather than found as a
hang or a wrong loss hours into the run.
"""
from __future__ import annotations

import json
from typing import Optional

from .. import provenance


def versions() -> dict[str, str]:
    """The versions a rank runs with (trainer.provenance reads them, as runs record them): a node with another
    DeepSpeed or torch computes other numbers, or hangs."""
    return {**provenance.versions(), "trainer": provenance.trainer_version() or "not installed"}


def disagreements(ranks: list[dict]) -> list[str]:
    """Problems across the ranks' reports (each with 'versions', 'config_hash', 'config_error', 'config'):
    every version that differs, a config that failed to resolve, and the keys where configs differ."""
    problems = [f"rank {r['rank']} ({r['host']}): the preset does not resolve: {r['config_error']}"
                for r in ranks if r.get("config_error")]
    for name in sorted({name for r in ranks for name in r["versions"]}):
        problem = _differs(f"{name} version", [(r["rank"], r["versions"].get(name, "missing")) for r in ranks])
        problems += [problem] if problem else []
    resolved = [r for r in ranks if not r.get("config_error")]
    if len({r["config_hash"] for r in resolved}) > 1:
        reference = resolved[0]
        for other in resolved[1:]:
            if other["config_hash"] != reference["config_hash"]:
                keys = config_differences(other["config"], reference["config"])
                problems.append(f"resolved-preset hash: rank {other['rank']} ({other['host']}) "
                                f"{_digest(other['config_hash'])} != rank {reference['rank']} "
                                f"{_digest(reference['config_hash'])}; differing keys (rank {other['rank']} vs rank "
                                f"{reference['rank']}): {', '.join(keys[:8]) or '?'}"
                                f"{' ...' if len(keys) > 8 else ''} (launch every node with the same preset file and "
                                f"--set items)")
    return problems


def _differs(what: str, values: list[tuple[int, str]]) -> Optional[str]:
    by_value: dict[str, list[int]] = {}
    for rank, value in values:
        by_value.setdefault(value, []).append(rank)
    if len(by_value) < 2:
        return None
    parts = [f"{value} on rank(s) {', '.join(map(str, ranks[:8]))}{' ...' if len(ranks) > 8 else ''}"
             for value, ranks in sorted(by_value.items(), key=lambda item: item[1][0])]
    return f"{what} differs: {'; '.join(parts)} (install the same stack on every node)"


def config_differences(a, b, path: str = "") -> list[str]:
    """Dotted keys where two resolved records differ, each as key=value_a vs value_b."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}" if path else str(key)
            out += config_differences(a.get(key, "<absent>"), b.get(key, "<absent>"), where)
        return out
    return [] if a == b else [f"{path}={_short(a)} vs {_short(b)}"]


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:40] + "..."


def _digest(config_hash: str) -> str:
    return config_hash.removeprefix("sha256:")[:12]
