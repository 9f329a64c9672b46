"""Figures drawn without pyplot: a bare matplotlib Figure on the Agg canvas (no global backend
switch, safe beside other threads and notebooks' own backends), saved whole as a PNG."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from lakeloader.contracts.errors import LakeloaderError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 110


def new_figure(what: str, size: tuple[float, float] = (8.0, 6.0)) -> Figure:
    """A Figure of ``size`` inches on the Agg canvas, laid out by matplotlib's constrained layout
    (labels, titles and legends beside the axes all inside the figure). Raises LakeloaderError
    ("plotting ``what`` needs matplotlib") when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise LakeloaderError(f"plotting {what} needs matplotlib: pip install matplotlib") from exc
    figure = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_png(figure: Figure, path: str | os.PathLike[str]) -> None:
    """Write ``figure`` to the PNG ``path``, its bounding box grown to every artist so nothing is
    cut at the edges."""
    figure.savefig(os.fspath(path), dpi=DPI, bbox_inches="tight", pad_inches=0.15)
