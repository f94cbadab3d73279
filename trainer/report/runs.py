"""A run directory's `metrics.jsonl` read back as what the figure draws (the line format is documented in
`trainer/train/metrics.py`): train lines, eval lines, skipped (non-finite) steps, loss spikes and resumes.

A resume event, `{"step": S, "event": "resume", "checkpoint": TAG, "world_size": W}`, rewinds every series to
step S: the lines logged past the checkpoint were lost with the crash and are re-trained after it, so the later
lines replace them. A file without the event (written before the trainer logged it) is rewound the same way
where a series' step goes backwards.

The file is streamed from its last line to its first (trainer.metrics_file.backward), which settles each line
as it is met: a line survives when no later resume event has a lower step and no later line of its series has
a step as low. What survives is kept in bounded structures (report.points), so a run of millions of steps or a
crash loop of 300,000 resumes reads in bounded memory. Lines that are not metrics lines (a torn write, bad
UTF-8, a string where a number goes) are skipped and named as file:line in the run's notes; only a run with
nothing to draw is an error. Keys this reader does not know (loss_scale, mfu, ...) are left out of the picture.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import ConfigError, UserError, short
from ..files import read_yaml_mapping, regular_file
from ..paths import is_there
from ..metrics_file import METRICS_FILE, Line, backward
from .points import MAX_DRAWN, Marks, Series


TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gb")
EVAL_PREFIX = "eval_loss"
EVAL_SOURCE = EVAL_PREFIX + "/"   # eval_loss/<source>: one series per eval source
SPIKES = "loss_spike"
MAX_EVAL_SOURCES = 12       # eval_loss/<source> series drawn; the others are counted in a note
MAX_NAMED_LINES = 20        # skipped lines named one by one in the notes; the others are counted
MAX_LISTED_RESUMES = 10     # resume steps the HTML table lists
# preference tuning (train/preference.py): drawn in the rewards panels when a run logged them
REWARD_KEYS = ("rewards/accuracy", "rewards/margin")
EVAL_REWARD_KEYS = tuple("eval_" + key for key in REWARD_KEYS)
# GRPO (train/rl/objective.py): the mean reward of the rollouts (its eval twin dashed) and the KL to the reference
RL_KEYS = ("reward/mean", "kl")
EVAL_RL_KEYS = ("eval_reward/mean",)
METRIC_KEYS = frozenset(TRAIN_KEYS + (EVAL_PREFIX,) + REWARD_KEYS + EVAL_REWARD_KEYS + RL_KEYS + EVAL_RL_KEYS)


@dataclass
class RunMetrics:
    """What one run logged, by metric name (TRAIN_KEYS, eval_loss, eval_loss/<source>), and what was left out."""
    directory: Path
    file: Path
    label: str = ""
    preset: Optional[str] = None
    series: dict[str, Series] = field(default_factory=dict)
    skipped: Marks = field(default_factory=Marks)       # skipped_step lines and non-finite train losses
    spikes: Series = field(default_factory=Series)
    resumes: Marks = field(default_factory=Marks)
    first_resumes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_LISTED_RESUMES))
    bad_lines: int = 0
    named_lines: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_NAMED_LINES))
    undrawn_sources: list[str] = field(default_factory=list)   # the names of a few eval sources not drawn
    undrawn_source_values: int = 0
    notes_before: list[str] = field(default_factory=list)

    def get(self, name: str) -> Series:
        return self.series.get(name) or Series()

    def has_rewards(self) -> bool:
        """A preference run's: it logged rewards/* (train or eval)."""
        return any(self.get(key).count for key in REWARD_KEYS + EVAL_REWARD_KEYS)

    def has_rl(self) -> bool:
        """A GRPO run's: it logged reward/mean (train or eval) or kl."""
        return any(self.get(key).count for key in RL_KEYS + EVAL_RL_KEYS)

    def eval_sources(self) -> list[str]:
        return sorted(name for name in self.series if name.startswith(EVAL_SOURCE))

    def last_step(self) -> int:
        return max((s.last_step for s in self.series.values() if s.count), default=0)

    def undrawn_values(self) -> int:
        """Values drawn as gaps that no mark explains (a non-finite loss is a skipped step's)."""
        counts = [(name, *series.undrawable) for name, series in [*self.series.items(), (SPIKES, self.spikes)]]
        return sum(huge + (0 if name == "loss" else nonfinite) for name, nonfinite, huge in counts)

    def skip(self, line: Line, problem: str) -> None:
        self.bad_lines += 1
        self.named_lines.appendleft((line.number, problem))   # read backwards: keeps the first lines of the file

    def summary(self) -> str:
        """The notes in a few words, for the figure ('' when the figure shows everything the file holds)."""
        parts = [f"{self.bad_lines:,} line(s) skipped" if self.bad_lines else "",
                 f"{self.undrawn_source_values:,} eval value(s) of more sources not drawn"
                 if self.undrawn_source_values else "",
                 f"{self.undrawn_values():,} value(s) not drawable" if self.undrawn_values() else ""]
        parts += [f"{marks.count:,} {what} merged into {len(marks.ranges())} marks"
                  for marks, what in ((self.resumes, "resumes"), (self.skipped, "skipped steps")) if marks.merged]
        return ", ".join(p for p in parts if p)

    def notes(self) -> list[str]:
        """What the figure leaves out or merges, each naming the file (and line) it comes from."""
        notes = list(self.notes_before)
        notes += [f"{self.file}:{number}: {problem}; line skipped" for number, problem in self.named_lines]
        if self.bad_lines:
            named = f" (the first {MAX_NAMED_LINES} are named above)" if self.bad_lines > MAX_NAMED_LINES else ""
            notes.append(f"{self.file}: {self.bad_lines:,} line(s) skipped in all{named}, the others are drawn; "
                         f"fix or delete them (a line cut short by a crash or a full disk can go)")
        if self.undrawn_source_values:
            notes.append(f"{self.file}: eval sources past the first {MAX_EVAL_SOURCES} met (from the end of the "
                         f"file) are not drawn: {', '.join(self.undrawn_sources)}, ...; "
                         f"{self.undrawn_source_values:,} value(s)")
        if self.undrawn_values():
            notes.append(f"{self.file}: {self.undrawn_values():,} value(s) are not finite or beyond "
                         f"+-{MAX_DRAWN:g}: drawn as gaps")
        for marks, what in ((self.resumes, "resume(s)"), (self.skipped, "skipped step(s)")):
            if marks.merged:
                notes.append(f"{self.file}: {marks.count:,} {what} drawn as {len(marks.ranges())} marks, each "
                             f"merging the ones within a range of steps")
        return notes


def metrics_file(run: str) -> tuple[Path, Path]:
    """(run directory, its metrics.jsonl) for a RUN_DIR argument (the metrics file itself is accepted too)."""
    path = Path(run).expanduser()
    if path.suffix == ".jsonl" and not (path / METRICS_FILE).exists():  # a directory named x.jsonl is named as one
        return path.parent, regular_file(path, "metrics file")
    if not is_there(path, "run directory"):
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
    """One run's surviving history; lines that are not metrics lines are skipped and named in its notes."""
    directory, file = metrics_file(run)
    metrics = RunMetrics(directory, file)
    metrics.preset = _preset_name(directory, metrics.notes_before)
    history = _History(metrics)
    try:
        for line in backward(file):
            problem = line.problem or history.take(line.row)
            if problem:
                metrics.skip(line, problem)
    except OSError as err:
        raise UserError(f"metrics file {file}: cannot read it ({err.strerror})") from None
    if not any(s.count for s in metrics.series.values()):
        why = f"; its {metrics.bad_lines:,} non-blank line(s) are not metrics lines, e.g. " \
              f"{file}:{metrics.named_lines[0][0]}: {metrics.named_lines[0][1]}" if metrics.bad_lines else ""
        raise UserError(f"metrics file {file} has no train or eval line yet: nothing to draw (the run logs every "
                        f"logging.log_every steps){why}; leave this run out")
    return metrics


class _History:
    """Lines fed from the file's last to its first, kept only where the run's surviving history has them."""

    def __init__(self, metrics: RunMetrics):
        self.metrics = metrics
        self.resumed_to = math.inf                 # the lowest step a resume later in the file went back to
        self.floors: dict[str, int] = {}           # per series: the lowest step a later line of it has
        self.eval_sources = 0                      # eval_loss/<source> series met

    def survives(self, kind: str, step: int) -> bool:
        """Whether a line of `kind` at `step` is in the history: no later resume went back before it, and no later
        line of its kind re-logged its step or an earlier one (a resume without its event line)."""
        floor = self.floors.get(kind)
        self.floors[kind] = step if floor is None else min(floor, step)
        return step <= self.resumed_to and (floor is None or step < floor)

    def take(self, row: dict) -> Optional[str]:
        """Adds the line; a problem that makes it no metrics line (it is then skipped whole), else None. The path
        of a train line is kept short: it runs once per logged step."""
        step = row["step"]
        if "event" in row and row["event"] == "resume":
            return self._resume(row, step)
        if row.get("skipped_step") is True:
            if self.survives("skipped", step):
                self.metrics.skipped.add(step)
            return None
        if SPIKES in row:
            value, problem = _number(row, SPIKES)
            if problem is None and self.survives(SPIKES, step):
                self.metrics.spikes.add(step, value)
            return problem
        values = []
        for key, value in row.items():
            if value is not None and (key in METRIC_KEYS or key.startswith(EVAL_SOURCE)):
                if type(value) is not float:  # null: not measured (no grad norm on a skipped update)
                    value, problem = _number(row, key)
                    if problem:
                        return problem
                values.append((key, value))
        floors, resumed_to = self.floors, self.resumed_to
        for key, value in values:
            floor = floors.get(key)
            if floor is None and not self._room_for(key):
                continue
            if floor is None or step < floor:   # survives(key, step), inline
                floors[key] = step
                if step <= resumed_to:
                    self._add_to(key, step, value)
            if key == "loss" and not math.isfinite(value) and self.survives("skipped", step):
                self.metrics.skipped.add(step)  # a non-finite loss marks its step (once with its skipped line)
        return None

    def _resume(self, row: dict, step: int) -> Optional[str]:
        checkpoint, world = row.get("checkpoint"), row.get("world_size")
        if not isinstance(checkpoint, str) or not (world is None or _is_int(world)):
            return "a resume event has \"checkpoint\": <tag> and \"world_size\": <ranks>"
        self.metrics.resumes.add(step)
        self.metrics.first_resumes.appendleft(step)
        self.resumed_to = min(self.resumed_to, step)
        return None

    def _room_for(self, key: str) -> bool:
        """Whether a series not met yet is kept: an eval source past the first MAX_EVAL_SOURCES is only counted
        (a file of a million source names would otherwise be a million series)."""
        metrics = self.metrics
        if not key.startswith(EVAL_SOURCE) or self.eval_sources < MAX_EVAL_SOURCES:
            self.eval_sources += key.startswith(EVAL_SOURCE)
            return True
        metrics.undrawn_source_values += 1
        if key not in metrics.undrawn_sources and len(metrics.undrawn_sources) < 3:
            metrics.undrawn_sources.append(key)
        return False

    def _add_to(self, key: str, step: int, value: float) -> None:
        series = self.metrics.series.get(key)
        if series is None:
            series = self.metrics.series[key] = Series()
        series.add(step, value)


def drawable(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= MAX_DRAWN


def _number(row: dict, key: str) -> tuple[float, Optional[str]]:
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan, f"{key!r} must be a number, got {short(value, 60)}"
    try:
        return float(value), None
    except OverflowError:  # a whole number past float's range (a float literal past it reads as inf)
        return math.nan, f"{key!r} is too large to be a metric ({short(value, 40)})"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _preset_name(directory: Path, notes: list[str]) -> Optional[str]:
    """The preset's name from the run's config.resolved.yaml (absent in a directory that is only metrics; a file
    that cannot be read only costs the label its preset, with a note)."""
    resolved = directory / "config.resolved.yaml"
    if not resolved.exists():
        return None
    try:
        name = read_yaml_mapping(resolved, "resolved config").get("name")
    except UserError as err:
        notes.append(f"{err}; the run is labelled without its preset")
        return None
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
