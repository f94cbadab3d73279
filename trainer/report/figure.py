"""The report's figure: six panels on one step axis (train loss, eval loss, learning rate, grad norm,
tokens/s, peak memory), and two more when a run did preference tuning (rewards/accuracy and rewards/margin, with
their eval_rewards/* values dashed) or GRPO (reward/mean with eval_reward/mean dashed, and kl), one colour per run, resumes as dashed vertical lines in the run's colour, skipped
(non-finite) steps as red dotted ones, loss spikes as triangles on the loss panel. Where a run has more marks
than report.points keeps, a mark that merges several steps is a light band over their range. Values that are
not finite or too large for an axis are gaps. What a run's reading left out (skipped lines, merged marks) is
one grey entry of the legend; its notes name each.

Every drawn line (or band) carries a gid, "<run label>:<what>" (what = a metric name, eval_loss/<source>,
eval_rewards/<name>, resume, skipped, loss_spike), so that a program (the tests) can read back exactly what was drawn.
"""
from __future__ import annotations

import math

from ..pictures import new_figure
from .points import Marks, Series
from .runs import REWARD_KEYS, RunMetrics, drawable

DASHED_EVAL = REWARD_KEYS + ("reward/mean",)  # panels that also draw their eval_* twin, dashed


PANELS = (  # metric, title, y label
    ("loss", "train loss", "loss"),
    ("eval_loss", "eval loss", "loss"),
    ("lr", "learning rate", "lr"),
    ("grad_norm", "grad norm", "L2 norm"),
    ("tokens_per_s", "throughput", "tokens/s (all ranks)"),
    ("peak_mem_gb", "peak memory (GPU allocated; RSS on CPU ranks)", "GB"),
)
REWARD_PANELS = (  # preference runs only
    ("rewards/accuracy", "preference accuracy (rewards/accuracy; eval dashed)", "share of pairs"),
    ("rewards/margin", "reward margin (rewards/margin; eval dashed)", "beta x log-ratio"),
)
RL_PANELS = (  # GRPO runs only
    ("reward/mean", "GRPO reward (reward/mean; eval dashed)", "mean reward"),
    ("kl", "KL to the reference (kl, per token)", "nats"),
)
EVAL_STYLE = {"linestyle": "--", "marker": "o", "markersize": 3.5, "linewidth": 1.2}
LOG_RATIO = 30.0      # a panel whose positive values span more than this factor is drawn on a log scale
RESUME_STYLE = {"linestyle": "--", "linewidth": 1.3, "alpha": 0.8}
SKIP_STYLE = {"color": "tab:red", "linestyle": ":", "linewidth": 1.2, "alpha": 0.7}
BAND_ALPHA = 0.15     # a mark merging a range of steps


def report_figure(runs: list[RunMetrics]):
    """The Figure for these runs (the caller saves it)."""
    panels = (PANELS + (REWARD_PANELS if any(run.has_rewards() for run in runs) else ())
              + (RL_PANELS if any(run.has_rl() for run in runs) else ()))
    figure = new_figure(13, 3.5 * (len(panels) // 2))
    axes = figure.subplots(len(panels) // 2, 2, sharex=True).flatten()
    colours = [f"C{i % 10}" for i in range(len(runs))]
    widths = [2.8 - 1.4 * i / max(len(runs) - 1, 1) for i in range(len(runs))]  # equal curves stay visible
    sources = sorted({s for run in runs for s in run.eval_sources()})  # one dash pattern per eval source
    for ax, (metric, title, ylabel) in zip(axes, panels):
        ax.set_title(title, fontsize=11)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        for run, colour, width in zip(runs, colours, widths):
            _draw_metric(ax, run, metric, colour, sources, width)
            _draw_markers(ax, run, colour, spikes=metric == "loss")
        _scale(ax, [v for run in runs for v in _values(run, metric)],
               log_allowed=metric != "lr" and metric not in DASHED_EVAL)
        if not any(run.get(key).steps for run in runs for key in _keys(metric)):
            ax.text(0.5, 0.5, f"no {metric} logged", transform=ax.transAxes, ha="center", va="center",
                    color="grey")
        if metric == "eval_loss" and sources:
            ax.legend(handles=_source_handles(sources), fontsize=8, loc="upper right", title="eval sources",
                      title_fontsize=8)
    from matplotlib.ticker import MaxNLocator
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps (the x axis is shared)
    for ax in axes[-2:]:
        ax.set_xlabel("step")
    steps = max(run.last_step() for run in runs)
    figure.suptitle(f"{len(runs)} run(s), up to step {steps}", fontsize=12)
    figure.legend(handles=_legend_handles(runs, colours), loc="outside lower center",
                  ncols=min(4, len(runs) + 3), fontsize=9, frameon=False)
    return figure


def _draw_metric(ax, run: RunMetrics, metric: str, colour: str, sources: list[str], width: float) -> None:
    series = run.get(metric)
    if series.steps:
        marker = "o" if metric == "eval_loss" or len(series.steps) < 30 else None
        ax.plot(series.steps, _drawn(series), color=colour, marker=marker, markersize=1.5 + width, linewidth=width,
                gid=f"{run.label}:{metric}")
    if metric in DASHED_EVAL and run.get("eval_" + metric).steps:
        held_out = run.get("eval_" + metric)
        ax.plot(held_out.steps, _drawn(held_out), color=colour, gid=f"{run.label}:eval_{metric}", **EVAL_STYLE)
    if metric == "eval_loss":
        for source in run.eval_sources():
            part = run.get(source)
            ax.plot(part.steps, _drawn(part), color=colour, linestyle=_dashes(sources, source), linewidth=1.0,
                    marker=".", markersize=3, alpha=0.8, gid=f"{run.label}:{source}")


def _drawn(series: Series) -> list[float]:
    """The series' values, NaN (a gap) where a value cannot be drawn."""
    return [v if drawable(v) else math.nan for v in series.values]


def _draw_markers(ax, run: RunMetrics, colour: str, spikes: bool) -> None:
    _draw_marks(ax, run.resumes, f"{run.label}:resume", {"color": colour, **RESUME_STYLE})
    _draw_marks(ax, run.skipped, f"{run.label}:skipped", SKIP_STYLE)
    if spikes and run.spikes.count:
        ax.plot(run.spikes.steps, _drawn(run.spikes), linestyle="none", marker="v", markersize=8, color=colour,
                markeredgecolor="black", gid=f"{run.label}:loss_spike")


def _draw_marks(ax, marks: Marks, gid: str, style: dict) -> None:
    for first, last, _ in marks.ranges():
        if first == last:
            ax.axvline(first, gid=gid, **style)
        else:
            ax.axvspan(first, last, color=style["color"], alpha=BAND_ALPHA, linewidth=0, gid=gid)


def _keys(metric: str) -> tuple[str, ...]:
    """The series a panel draws: a rewards panel also has its eval_rewards/* values."""
    return (metric, "eval_" + metric) if metric in DASHED_EVAL else (metric,)


def _values(run: RunMetrics, metric: str) -> list[float]:
    values = [v for key in _keys(metric) for v in run.get(key).values]
    if metric == "eval_loss":
        values += [v for source in run.eval_sources() for v in run.get(source).values]
    if metric == "loss":
        values += run.spikes.values
    return [v for v in values if drawable(v)]


def _scale(ax, values: list[float], log_allowed: bool) -> None:
    """Log scale where the values span orders of magnitude (grad norm spikes, loss from scratch), else linear."""
    if log_allowed and values and min(values) > 0 and max(values) / min(values) > LOG_RATIO:
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)


def _legend_handles(runs: list[RunMetrics], colours: list[str]) -> list:
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=c, linewidth=2.5, label=run.label) for run, c in zip(runs, colours)]
    if any(run.resumes for run in runs):
        handles.append(Line2D([], [], color="black", label="resume (run's colour)", **RESUME_STYLE))
    if any(run.skipped for run in runs):
        handles.append(Line2D([], [], label="skipped / non-finite step", **SKIP_STYLE))
    if any(run.spikes.count for run in runs):
        handles.append(Line2D([], [], linestyle="none", marker="v", color="grey", markeredgecolor="black",
                              label="loss spike"))
    for run in runs:
        if run.summary():
            handles.append(Line2D([], [], linestyle="none", label=f"{run.label}: {run.summary()} (see the notes)"))
    return handles


def _dashes(sources: list[str], source: str) -> tuple:
    i = sources.index(source)
    return (0, (1 + i, 1 + i))


def _source_handles(sources: list[str]) -> list:
    from matplotlib.lines import Line2D
    return [Line2D([], [], color="grey", linewidth=1.6, marker="o", markersize=3.5, label="all sources")] + [
        Line2D([], [], color="grey", linestyle=_dashes(sources, s), marker=".", label=s.split("/", 1)[1])
        for s in sources]
