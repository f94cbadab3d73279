"""Figures for the commands that draw (`report`, `plan --chart`): matplotlib on its Agg backend, imported only
when a picture is asked for (every other command starts without it), and PNG bytes written whole or not at all.

Figures are built with `matplotlib.figure.Figure`, not pyplot: no global figure registry, no GUI backend chosen
from the environment (a cluster login node has no display), and a figure that the caller (or a test) can read
back: its lines' data, its bars' heights.
"""
from __future__ import annotations

import io
from pathlib import Path

from .errors import UserError
from .files import write_bytes_atomic


DPI = 110


def new_figure(width: float, height: float):
    """An empty Figure on the Agg canvas, laid out by matplotlib's constrained layout (labels do not overlap)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("drawing needs matplotlib, which is not installed: pip install matplotlib==3.11.2 "
                        "(or reinstall the trainer: pip install -e .)") from None
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def png_bytes(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def save_png(figure, target: str, flag: str) -> Path:
    """The figure as a PNG at `target`, written atomically (a temporary file beside it, then renamed)."""
    return write_bytes_atomic(target, png_bytes(figure), flag)


def check_suffix(target: str, flag: str, allowed: tuple[str, ...]) -> str:
    """The output's suffix (lower case) when it is one of `allowed`, else a UserError that lists them."""
    suffix = Path(target).suffix.lower()
    if suffix not in allowed:
        raise UserError(f"{flag} {target}: the file name must end in {' or '.join(allowed)} (that is what is "
                        f"written){'' if suffix else '; add the suffix'}")
    return suffix
