"""`python -m trainer report RUN_DIR [RUN_DIR ...] -o report.png|report.html`: one or several runs' curves on
shared axes. The .html is one self-contained file: the PNG embedded (base64) and a table of each run's final
values. Nothing is written unless every run reads cleanly; the output is written whole or not at all."""
from __future__ import annotations

import argparse
import base64
import html
import math
import os
import sys
from pathlib import Path
from typing import Optional

from .. import paths
from ..errors import UserError
from ..files import check_target, write_text_atomic
from ..pictures import check_suffix, png_bytes, save_png
from .runs import RunMetrics, metrics_file, read_runs


SUFFIXES = (".png", ".html")


def report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories (train.output_dir) or their metrics.jsonl; several share the axes")
    parser.add_argument("-o", "--output", required=True, type=paths.output_file("report", suffixes=(".png", ".html")),
                        help="report.png (the figure) or report.html (the figure and a table of final values)")


def report(args) -> int:
    suffix = check_suffix(args.output, "-o", SUFFIXES)
    target = check_target(args.output)  # refused before any run is read
    for run in args.runs:
        check_not_input(target, run)
    runs = read_runs(args.runs)
    from .figure import report_figure  # matplotlib is imported here, by this command only
    figure = report_figure(runs)
    if suffix == ".png":
        out = save_png(figure, args.output, "-o")
    else:
        out = write_text_atomic(args.output, report_html(runs, png_bytes(figure)))
    for note in (note for run in runs for note in run.notes()):
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {out} ({len(runs)} run(s))", file=sys.stderr)
    return 0


def check_not_input(target: Path, run: str) -> None:
    """-o must not be a run's metrics file (through a link or a second name): writing it would replace the input."""
    try:
        _, file = metrics_file(run)
    except UserError:
        return  # read_runs reports it with every other run's problem
    if target.exists() and os.path.samefile(target, file):
        raise UserError(f"-o {target} is the metrics file of {run}: the report would replace the run's history; "
                        f"write it elsewhere")


# --- the HTML page ---------------------------------------------------------------------------------

COLUMNS = ("run", "directory", "last step", "loss", "eval loss", "eval ppl", "lr", "grad norm", "tokens/s",
           "peak mem GB", "skipped steps", "resumes")


def final_values(run: RunMetrics) -> dict[str, object]:
    """The table row of one run: its last value of each metric (peak memory: the largest)."""
    eval_loss = run.get("eval_loss").last
    return {"run": run.label, "directory": str(run.directory), "last step": run.last_step(),
            "loss": run.get("loss").last, "eval loss": eval_loss,
            "eval ppl": None if eval_loss is None else _perplexity(eval_loss), "lr": run.get("lr").last,
            "grad norm": run.get("grad_norm").last, "tokens/s": run.get("tokens_per_s").last,
            "peak mem GB": run.get("peak_mem_gb").peak, "skipped steps": run.skipped.count,
            "resumes": _resumes(run)}


def _resumes(run: RunMetrics) -> str:
    listed = ", ".join(f"step {step}" for step in run.first_resumes) or "none"
    more = run.resumes.count - len(run.first_resumes)
    return f"{listed}, ... ({run.resumes.count:,} in all)" if more else listed


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # as the trainer's eval_ppl: capped, so a diverged run shows a number


def _cell(value: Optional[object]) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def report_html(runs: list[RunMetrics], png: bytes) -> str:
    image = base64.b64encode(png).decode("ascii")
    header = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    rows = "\n".join("<tr>" + "".join(f"<td>{_cell(final_values(run)[c])}</td>" for c in COLUMNS) + "</tr>"
                     for run in runs)
    title = html.escape(f"Training report: {', '.join(run.label for run in runs)}")
    noted = [note for run in runs for note in run.notes()]
    notes = "<h2>Notes</h2>\n<ul>\n" + "".join(f"<li>{html.escape(n)}</li>\n" for n in noted) + "</ul>\n" \
        if noted else ""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; margin-top: 1em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
th:first-child, td:first-child, th:nth-child(2), td:nth-child(2) {{ text-align: left; }}
img {{ max-width: 100%; }}
</style>
</head>
<body>
<h1>{title}</h1>
<img alt="loss, eval loss, learning rate, grad norm, tokens/s and peak memory by step" src="data:image/png;base64,{image}">
<h2>Final values</h2>
<table>
<tr>{header}</tr>
{rows}
</table>
<p>Last logged value of each metric (peak memory: the largest). Resumes are the steps a run restarted from a
checkpoint; skipped steps are the updates dropped for a non-finite loss or gradient.</p>
{notes}</body>
</html>
"""
