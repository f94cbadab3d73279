"""Known version regressions, as data: versions.yaml holds one row per regression (the package, the error's
signature, the broken versions, the fixed or known-good release, the source). A row matches when its signature
is in the log and the versions the log prints - or the run recorded in its config.resolved.yaml - are in its
broken range (a version outside it rules the row out; no version at all leaves it in).

The versions a log prints come in many shapes - `deepspeed==0.16.5`, `DeepSpeed version: 0.16.5`, HF's
"- `Accelerate` version: 0.27.2", `PyTorch version (GPU?): 2.0.1+cu117`, ds_report's dotted columns, pip's
"Name: accelerate Version: 1.10.1" and "deepspeed   0.8.0" - and are read by the same few patterns for every
package.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ... import ds as dsc
from ... import files
from ...errors import UserError
from ..advice import TRAINER_DEEPSPEED
from ..findings import Diagnosis, Found, Proposal
from ..logtext import Log

TABLE = Path(__file__).with_name("versions.yaml")
PACKAGES = {"deepspeed": "deepspeed", "torch": "torch", "pytorch": "torch", "transformers": "transformers",
            "accelerate": "accelerate", "peft": "peft", "trl": "trl", "datasets": "datasets", "nccl": "nccl"}
NUMBER = r"v?(\d+\.\d+(?:\.\d+)?(?:[.+][\w.]+)?)"
_NAME = r"`?(" + "|".join(PACKAGES) + r")`?"
VERSION_SHAPES = [re.compile(p, re.IGNORECASE | re.MULTILINE) for p in (
    rf"\b{_NAME}==\s*{NUMBER}",                                               # deepspeed==0.16.5
    rf"\b{_NAME}\s*(?:info|version)(?:\s*\([^)]*\))?[\s.]*[:=]?\s*(?:version=)?{NUMBER}",  # X version: 1.2 / ds_report
    rf"\bversion of {_NAME}\W{{0,3}}{NUMBER}",                                # Version of accelerate: 0.9.0
    rf"\b{_NAME}\s+version\s+is\s+`?{NUMBER}",                                # the PyTorch Version is `1.1.0`
    rf"\bName:\s*{_NAME}\s+Version:\s*{NUMBER}",                              # pip show
    rf"^\s*[-*]?\s*{_NAME}\s+{NUMBER}\s*$",                                   # pip list / pip freeze columns
)]


def log_versions(text: str) -> dict[str, str]:
    """Package -> the first version the log prints for it."""
    found: dict[str, str] = {}
    for shape in VERSION_SHAPES:
        for match in shape.finditer(text):
            found.setdefault(PACKAGES[match.group(1).lower()], match.group(2))
    return found


def record_versions(log_path: Optional[str]) -> dict[str, str]:
    """The versions a run recorded (config.resolved.yaml's provenance) when the log sits in its run directory."""
    if not log_path:
        return {}
    record = Path(log_path).expanduser().resolve().parent / "config.resolved.yaml"
    if not record.is_file():
        return {}
    try:
        versions = (files.read_yaml_mapping(record, "run record").get("provenance") or {}).get("versions") or {}
    except UserError:
        return {}
    return {name: str(v) for name, v in versions.items() if name in PACKAGES.values() and v}


# --- version ranges --------------------------------------------------------------------------------------------


def version_tuple(version: str) -> tuple[int, ...]:
    """'2.0.1+cu117' -> (2, 0, 1); pre-releases and local labels are ignored."""
    return tuple(int(part) for part in re.findall(r"\d+", re.split(r"[+\-a-zA-Z]", version, maxsplit=1)[0])[:3])


_COMPARE = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
            "<": lambda a, b: a < b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}


def in_range(version: str, spec: str) -> bool:
    """Whether `version` satisfies every clause of a specifier set such as '>=0.30.0,<0.34.0'."""
    have = version_tuple(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, bound = re.match(r"(>=|<=|==|!=|>|<)\s*(.+)", clause).groups()
        want = version_tuple(bound)
        width = max(len(have), len(want))
        if not _COMPARE[op](have + (0,) * (width - len(have)), want + (0,) * (width - len(want))):
            return False
    return True


# --- the table -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Regression:
    package: str
    signature: re.Pattern
    broken: str
    what: str
    source: str
    fixed: Optional[str] = None
    pin: Optional[str] = None
    requires: Optional[str] = None  # 'torch>=2.0': the other package's versions the failure needs
    workaround: Optional[str] = None

    def applies(self, versions: dict[str, str]) -> bool:
        have = versions.get(self.package)
        if have and not in_range(have, self.broken):
            return False
        if self.requires:
            name, spec = re.match(r"([\w-]+)\s*(.*)", self.requires).groups()
            other = versions.get(name)
            if other and not in_range(other, spec):
                return False
        return True


ROW_KEYS = {"package", "signature", "broken", "what", "source", "fixed", "pin", "requires", "workaround"}


@functools.lru_cache(maxsize=1)
def table() -> tuple[Regression, ...]:
    rows = files.parse_yaml(files.read_text(TABLE, "version table"), f"version table {TABLE}")
    out = []
    for n, row in enumerate(rows, 1):
        unknown, missing = set(row) - ROW_KEYS, {"package", "signature", "broken", "what", "source"} - set(row)
        if unknown or missing or not (row.get("fixed") or row.get("pin")):
            raise UserError(f"version table {TABLE} row {n}: unknown keys {sorted(unknown)}, missing {sorted(missing)}"
                            f" or neither `fixed` nor `pin`")
        out.append(Regression(**{**row, "signature": re.compile(row["signature"])}))
    return tuple(out)


def find(log: Log, versions: dict[str, str]) -> Optional[tuple[int, Regression]]:
    """The first row whose signature the log shows and whose broken range holds the log's versions."""
    for row in table():
        index = log.first(row.signature)
        if index is not None and row.applies(versions):
            return index, row
    return None


def diagnose(f: Found) -> Diagnosis:
    versions = f.versions
    _, row = find(f.log, versions)
    have = versions.get(row.package)
    seen = f"{row.package} {have}, " if have else ""
    d = Diagnosis("version", f"a known {row.package} regression ({seen}broken in {row.package}{row.broken})", f.line)
    if row.fixed:
        d.proposal = Proposal(f"upgrade {row.package}: pip install '{row.package}>={row.fixed}'", [],
                              f"{row.what}; fixed in {row.fixed} ({row.source})")
    else:
        d.proposal = Proposal(f"pin {row.package}: pip install '{row.package}=={row.pin}'", [],
                              f"{row.what}; {row.pin} is the release the source confirms working ({row.source})")
    if row.workaround == "zero_force_ds_cpu_optimizer":
        d.then.append(Proposal("or keep this DeepSpeed and let ZeRO-Offload run the client optimizer",
                               [dsc.client_optimizer_on_cpu_override()],
                               "the optimizer is a DeepSpeed CPU optimizer, so the check that refuses it is the bug"))
    if not have:
        d.advice.append(f"the log prints no {row.package} version: check it with `pip show {row.package}` "
                        f"(broken: {row.broken})")
    if row.package == "deepspeed":
        d.advice.append(f"this trainer pins and is tested on DeepSpeed {TRAINER_DEEPSPEED}: if the trainer itself hit "
                        f"this, reinstall its pin (`pip install deepspeed=={TRAINER_DEEPSPEED}`) and report it")
    return d
