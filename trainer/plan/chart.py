"""`plan --chart plan.png`: the plan's table as a picture. One stacked bar per candidate the planner priced
(parameters, gradients, optimizer states, activations, buffers: `Estimate.gpu_bytes`, the numbers the table
prints) against the per-GPU budget line, the chosen candidate outlined; beside it, each candidate's host RAM per
node against the host budget (when --cpu-ram-gb gives one), on a log scale when they span orders of magnitude.

The table prices every candidate at the same micro-batch; the choice is then grown to the largest micro-batch
that fits (and may gain ZeRO++ hpZ), so when its numbers differ from its row it gets a bar of its own.
Bars far over the budget are cut at the top of the axis and labelled with their total, so the budget and the
bars that fit stay readable. Every artist carries a gid ("<candidate>:<part>", "budget", "gpu_memory", ...).
"""
from __future__ import annotations

from ..pictures import new_figure
from .estimate import GPU_HEADROOM, HOST_HEADROOM, Estimate, Plan, budgets
from .memory import GB


PARTS = (  # Estimate.gpu_bytes key, legend label, colour
    ("params", "parameters", "#4c72b0"),
    ("gradients", "gradients", "#dd8452"),
    ("optimizer", "optimizer states", "#55a868"),
    ("activations", "activations", "#8172b3"),
    ("buffers", "buffers / other", "#8c8c8c"),
)
HOST_COLOUR = "#64b5cd"
HOST_LOG_RATIO = 30.0  # host bars spanning more than this factor are drawn on a log scale (they are not stacked)
HEADROOM_OVER = 1.8   # the axis shows up to this many budgets (or the chosen bar), taller bars are cut


def bars(plan: Plan) -> list[tuple[str, Estimate, bool]]:
    """(label, estimate, chosen) per bar: every candidate's row, then the choice at its own micro-batch where
    that differs from its row."""
    choice = plan.choice
    out = []
    for row in plan.rows:
        label = row.candidate.name + (" (ckpt)" if row.checkpointing else "")
        out.append((label, row, choice is not None and row.candidate.name == choice.candidate.name
                    and row.gpu_bytes() == choice.gpu_bytes()))
    if choice is not None and not any(chosen for _, _, chosen in out):
        hpz = f", hpZ {choice.hpz_partition_size}" if choice.hpz_partition_size > 1 else ""
        out.append((f"chosen: {choice.candidate.name}\nmicro-batch {choice.micro_batch}{hpz}"
                    + (" (ckpt)" if choice.checkpointing else ""), choice, True))
    return out


def plan_figure(plan: Plan):
    """The Figure of the plan's candidates (the caller saves it)."""
    figure = new_figure(13.5, 9.5)
    gpu_ax, host_ax = figure.subplots(2, 1, sharex=True, height_ratios=(2.3, 1))
    drawn = bars(plan)
    _gpu_panel(gpu_ax, plan, drawn)
    _host_panel(host_ax, plan, drawn)
    inputs = plan.inputs
    verdict = (f"chosen: {plan.choice.candidate.name}, micro-batch {plan.choice.micro_batch}" if plan.choice
               else "fits nowhere")
    figure.suptitle(f"{inputs.model.label}, {inputs.params / 1e9:.2f}B params, {inputs.task}, seq {inputs.seq_len}, "
                    f"{inputs.nodes} x {inputs.gpus_per_node} {inputs.gpu.name}: {verdict}", fontsize=12)
    return figure


def _gpu_panel(ax, plan: Plan, drawn: list) -> None:
    inputs = plan.inputs
    budget = budgets(inputs)[0] / GB
    memory = inputs.gpu.memory_bytes / GB
    xs = range(len(drawn))
    bottoms = [0.0] * len(drawn)
    for key, _, colour in PARTS:  # stacked from the bottom in PARTS order
        heights = [e.gpu_bytes()[key] / GB for _, e, _ in drawn]
        container = ax.bar(xs, heights, bottom=bottoms, color=colour, width=0.7)
        for patch, (name, e, chosen) in zip(container.patches, drawn):
            _mark(patch, f"{name}:{key}", e.fits, chosen)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    totals = [e.gpu_total / GB for _, e, _ in drawn]
    chosen_total = max([t for t, (_, _, c) in zip(totals, drawn) if c], default=0.0)
    top = max(min(max(totals), budget * HEADROOM_OVER), chosen_total * 1.15, memory * 1.08) * 1.06
    ax.set_ylim(0, top)
    ax.axhline(budget, color="tab:red", linewidth=2, gid="budget",
               label=f"budget {budget:.1f} GB ({100 - int(GPU_HEADROOM * 100)}% of the GPU)")
    ax.axhline(memory, color="grey", linestyle=":", linewidth=1.5, gid="gpu_memory",
               label=f"{inputs.gpu.name} memory {memory:.1f} GB")
    for x, total, (name, e, chosen) in zip(xs, totals, drawn):
        text = f"{total:,.1f}" + ("\nchosen" if chosen else "") + _why_not(e)
        if total > top * 0.92:  # no room above it (cut at the top of the axis): the label sits on the bar, boxed
            ax.text(x, min(total, top) - top * 0.015, f"{total:,.0f} GB" + ("\n(cut) ↑" if total > top else ""),
                    ha="center", va="top", fontsize=8,
                    bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "grey"})
        else:
            ax.text(x, total + top * 0.01, text, ha="center", va="bottom", fontsize=8,
                    fontweight="bold" if chosen else "normal")
    ax.set_ylabel("GB per GPU (1 GB = 1e9 bytes)")
    ax.set_title(f"GPU memory per GPU, every candidate at micro-batch {plan.rows[0].micro_batch} "
                 f"(hatched: does not fit; outlined: chosen)", fontsize=11)
    ax.grid(True, axis="y", alpha=0.3)
    # beside the axes, so that no bar or label is ever under it
    ax.legend(handles=_gpu_legend(ax), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)


def _host_panel(ax, plan: Plan, drawn: list) -> None:
    cpu_budget = budgets(plan.inputs)[1]
    xs = range(len(drawn))
    heights = [e.cpu_bytes_per_node / GB for _, e, _ in drawn]
    container = ax.bar(xs, heights, color=HOST_COLOUR, width=0.7, label="host RAM per node")
    for patch, (name, e, chosen) in zip(container.patches, drawn):
        _mark(patch, f"{name}:host", e.fits_cpu, chosen)
    if cpu_budget is not None:
        ax.axhline(cpu_budget / GB, color="tab:red", linewidth=2, gid="host_budget",
                   label=f"host budget {cpu_budget / GB:.0f} GB ({100 - int(HOST_HEADROOM * 100)}% of RAM)")
    else:
        ax.text(0.5, 0.92, "host RAM unknown (not checked): give --cpu-ram-gb", transform=ax.transAxes,
                ha="center", va="top", fontsize=9, color="grey")
    shown = [h for h in heights + [cpu_budget / GB if cpu_budget else 0.0] if h > 0]
    if shown and max(shown) / min(shown) > HOST_LOG_RATIO:  # offload needs TBs, ZeRO-3 a few GB: both visible
        ax.set_yscale("log")
        ax.set_ylim(min(shown) / 2, max(shown) * 3)
    else:
        ax.set_ylim(0, max(shown + [1.0]) * (1.15 if cpu_budget else 1.35))
    _candidate_ticks(ax, drawn)  # the shared x axis: the names under this, the lower panel
    ax.set_ylabel("GB per node")
    ax.set_title("host RAM per node (offload, pinned buffers)", fontsize=11)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)


def _mark(patch, gid: str, fits: bool, chosen: bool) -> None:
    patch.set_gid(gid)
    if not fits:
        patch.set_alpha(0.5)
        patch.set_hatch("//")
    if chosen:
        patch.set_edgecolor("black")
        patch.set_linewidth(2.2)


def _why_not(e: Estimate) -> str:
    """Under a bar that fits the GPU but not the plan: what else does not fit."""
    if not e.fits_gpu or e.fits:
        return ""
    return "\n" + " and ".join(what for what, ok in (("host RAM", e.fits_cpu), ("NVMe", e.fits_nvme)) if not ok)


def _gpu_legend(ax) -> list:
    from matplotlib.patches import Patch
    handles, _ = ax.get_legend_handles_labels()  # the budget and GPU memory lines
    return handles + [Patch(facecolor=colour, label=label) for _, label, colour in reversed(PARTS)]


def _candidate_ticks(ax, drawn: list) -> None:
    ax.set_xticks(range(len(drawn)), [name for name, _, _ in drawn], rotation=35, ha="right", fontsize=9)
    for tick, (_, _, chosen) in zip(ax.get_xticklabels(), drawn):
        if chosen:
            tick.set_fontweight("bold")
