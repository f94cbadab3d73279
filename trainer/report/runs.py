"""A run directory's `metrics.jsonl` read back as series to draw (the line format is documented in
`trainer/train/metrics.py`): train lines, eval lines, skipped (non-finite) steps, loss spikes and resumes.

A resume event, `{"step": S, "event": "resume", "checkpoint": TAG, "world_size": W}`, rewinds every series to
step S: the lines logged past the checkpoint were lost with the crash and are re-trained after it, so the later
lines replace them. A file without the event (written before the trainer logged it) is rewound the same way
where a series' step goes backwards. Keys this reader does not know (loss_scale, mfu, ...) are left out of the
picture; a known key with a value that is not a number is an error naming the file and line.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import ConfigError, UserError, short
from ..files import read_text, read_yaml_mapping, regular_file


METRICS_FILE = "metrics.jsonl"
MAX_METRICS_BYTES = 1 << 30  # ~4M logged steps; the file is read whole
TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gb")
EVAL_PREFIX = "eval_loss"
FIX = "fix or delete the line (a line cut short by a crash or a full disk can go; the others still draw)"


@dataclass
class Series:
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, step: int, value: float) -> None:
        if self.steps and step <= self.steps[-1]:
            self.rewind(step - 1)  # an older file's resume: the re-trained step replaces the lost one
        self.steps.append(step)
        self.values.append(value)

    def rewind(self, step: int) -> None:
        """Drop the points past `step`."""
        keep = next((i for i, s in enumerate(self.steps) if s > step), len(self.steps))
        del self.steps[keep:], self.values[keep:]

    @property
    def last(self) -> Optional[float]:
        return self.values[-1] if self.values else None


@dataclass(frozen=True)
class Resume:
    step: int
    checkpoint: str
    world_size: Optional[int]


@dataclass
class RunMetrics:
    """What one run logged, by metric name (TRAIN_KEYS, eval_loss, eval_loss/<source>)."""
    directory: Path
    file: Path
    label: str = ""
    preset: Optional[str] = None
    series: dict[str, Series] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)           # skipped_step lines and non-finite train losses
    spikes: list[tuple[int, float]] = field(default_factory=list)
    resumes: list[Resume] = field(default_factory=list)

    def get(self, name: str) -> Series:
        return self.series.get(name) or Series()

    def eval_sources(self) -> list[str]:
        return sorted(name for name in self.series if name.startswith(EVAL_PREFIX + "/"))

    def last_step(self) -> int:
        return max((s.steps[-1] for s in self.series.values() if s.steps), default=0)

    def rewind(self, step: int) -> None:
        for series in self.series.values():
            series.rewind(step)
        self.skipped = [s for s in self.skipped if s <= step]
        self.spikes = [(s, v) for s, v in self.spikes if s <= step]


def metrics_file(run: str) -> tuple[Path, Path]:
    """(run directory, its metrics.jsonl) for a RUN_DIR argument (the metrics file itself is accepted too)."""
    path = Path(run).expanduser()
    if path.is_file() and path.suffix == ".jsonl":
        return path.parent, path
    if not path.exists():
        raise UserError(f"run directory {run!r} does not exist: give a run's train.output_dir (runs/<preset>)")
    if not path.is_dir():
        raise UserError(f"run directory {run}: not a directory; give a run's train.output_dir or its "
                        f"{METRICS_FILE}")
    file = path / METRICS_FILE
    if not file.exists():
        raise UserError(f"run directory {run} has no {METRICS_FILE}: is it a run's train.output_dir? A run "
                        f"writes it from its first logged step (logging.log_every)")
    return path, regular_file(file, "metrics file")


def read_run(run: str) -> RunMetrics:
    """One run's metrics; every bad line of the file is reported at once, each as file:line."""
    directory, file = metrics_file(run)
    metrics = RunMetrics(directory, file, preset=_preset_name(directory))
    problems = []
    text = read_text(file, "metrics file", MAX_METRICS_BYTES, allow_empty=True)
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            _add_line(metrics, _parse(line))
        except ValueError as err:
            problems.append(f"{file}:{number}: {err}")
    if problems:
        raise ConfigError(problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else []))
    if not any(s.steps for s in metrics.series.values()):
        raise UserError(f"metrics file {file} has no train or eval line yet: nothing to draw (the run logs every "
                        f"logging.log_every steps); leave this run out")
    return metrics


def _parse(line: str) -> dict:
    try:
        row = json.loads(line)  # NaN and Infinity are accepted: the trainer writes a non-finite loss as NaN
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at column {err.colno}); {FIX}") from None
    except RecursionError:
        raise ValueError(f"nested too deeply to be a metrics line; {FIX}") from None
    if not isinstance(row, dict):
        raise ValueError(f"a metrics line is a JSON object {{\"step\": ...}}, not {type(row).__name__}; {FIX}")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"\"step\" must be a whole number >= 0, got {short(step, 60)}; {FIX}")
    return row


def _add_line(metrics: RunMetrics, row: dict) -> None:
    step = row["step"]
    if row.get("event") == "resume":
        checkpoint, world = row.get("checkpoint"), row.get("world_size")
        if not isinstance(checkpoint, str) or not (world is None or _is_int(world)):
            raise ValueError(f"a resume event has \"checkpoint\": <tag> and \"world_size\": <ranks>; {FIX}")
        metrics.rewind(step)
        metrics.resumes.append(Resume(step, checkpoint, world))
        return
    if row.get("skipped_step") is True:
        metrics.skipped.append(step)
        return
    if "loss_spike" in row:
        metrics.spikes.append((step, _number(row, "loss_spike")))
        return
    for key in TRAIN_KEYS + tuple(k for k in row if k == EVAL_PREFIX or k.startswith(EVAL_PREFIX + "/")):
        if row.get(key) is not None:  # null: not measured at that step (no grad norm on a skipped update)
            value = _number(row, key)
            metrics.series.setdefault(key, Series()).add(step, value)
            if key == "loss" and not math.isfinite(value):
                metrics.skipped.append(step)


def _number(row: dict, key: str) -> float:
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key!r} must be a number, got {short(value, 60)}; {FIX}")
    try:
        return float(value)
    except OverflowError:  # a whole number past float's range (a float literal past it reads as inf)
        raise ValueError(f"{key!r} is too large to be a metric ({short(value, 40)}); {FIX}") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _preset_name(directory: Path) -> Optional[str]:
    """The preset's name from the run's config.resolved.yaml (absent in a directory that is only metrics)."""
    resolved = directory / "config.resolved.yaml"
    if not resolved.exists():
        return None
    name = read_yaml_mapping(resolved, "resolved config").get("name")
    return name if isinstance(name, str) else None


def read_runs(runs: list[str]) -> list[RunMetrics]:
    """Every run's metrics, labelled so that no two share a label; all runs' problems reported together."""
    found, problems = [], []
    for run in runs:
        try:
            found.append(read_run(run))
        except ConfigError as err:
            problems += err.problems
        except UserError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError(problems, "the runs to report")
    label(found)
    return found


def label(runs: list[RunMetrics]) -> None:
    """Each run's label: its directory name (with its parent where two share a name), and the preset when the
    directory is not named after it."""
    names = [r.directory.resolve().name for r in runs]
    for run, name in zip(runs, names):
        if names.count(name) > 1:
            name = f"{run.directory.resolve().parent.name}/{name}"
        run.label = name if not run.preset or run.preset in name else f"{name} ({run.preset})"
    seen: dict[str, int] = {}
    for run in runs:  # the same directory given twice
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} #{seen[run.label]}"
