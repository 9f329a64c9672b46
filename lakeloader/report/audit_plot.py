"""The figure of a mixture audit: realized vs target share of each dataset, step by step."""

from __future__ import annotations

import os
from typing import Any

from lakeloader.catalog.audit import share_curves
from lakeloader.config import Config
from lakeloader.report.canvas import new_figure, save_png

# Deviations often coincide: a line style per dataset keeps each one visible.
_DASHES: tuple[Any, ...] = ("-", (0, (5, 2)), (0, (1, 1.5)), (0, (6, 2, 1, 2)), (0, (2, 3)))
_LEGEND: dict[str, Any] = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0,
                           "fontsize": "small"}


def plot_audit(config: Config | str | os.PathLike[str], first: int, stop: int,
               path: str | os.PathLike[str], *, max_steps: int = 20_000) -> None:
    """Draw the realized vs target share of each dataset of the config's mixture over steps
    ``[first, stop)`` into the PNG ``path``: on top, each dataset's share of the examples of steps
    ``first..k`` (thick) and its target (dashed); below, its deviation from the start of the stage
    against the bound of 2 examples; stage starts marked. The numbers are
    :func:`lakeloader.catalog.audit.share_curves` (``max_steps`` evenly spaced steps of a longer
    range). Needs matplotlib (a LakeloaderError says so)."""
    figure = new_figure("an audit", (12.0, 7.5))
    from matplotlib import colormaps
    from matplotlib.lines import Line2D
    from matplotlib.ticker import StrMethodFormatter

    curves = share_curves(config, first, stop, max_steps=max_steps)
    info = curves.attrs
    first, stop = info["first_step"], info["stop_step"]
    every_step = curves["step"].nunique() == stop - first
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    groups = list(curves.groupby("dataset", sort=False))   # in the mixture's order
    colors = colormaps["tab10" if len(groups) <= 10 else "tab20"]
    for number, (name, rows) in enumerate(groups):
        color = colors(number % colors.N)
        top.plot(rows["step"], rows["share"], color=color, lw=3.0, alpha=0.45, label=name)
        top.plot(rows["step"], rows["target_share"], color=color, lw=1.1, ls="--", zorder=3)
        style: dict[str, Any] = ({"ls": _DASHES[number % len(_DASHES)]} if every_step
                                 else {"ls": "none", "marker": ".", "ms": 1.5})
        bottom.plot(rows["step"], rows["deviation"], color=color, lw=1.2, alpha=0.85, label=name, **style)
    bottom.axhline(2.0, color="black", lw=1.0, ls=":", label="bound (2 examples)")
    for row, (number, start) in enumerate(info["stage_starts"].items()):
        for axis in (top, bottom):
            axis.axvline(start - 0.5, color="grey", lw=0.8, ls="-.")
        # two rows of labels: stages close together on a long range stay apart
        top.annotate(f"stage {number}", (start, 1.0), xycoords=("data", "axes fraction"),
                     xytext=(3, -12 - 11 * (row % 2)), textcoords="offset points", fontsize="small", color="grey")

    top.set_title(f"mixture {info['mixture_id']}: realized vs target share\nbatch {info['batch_size']}, "
                  f"steps [{first:,}, {stop:,}), from the {info['source']}", fontsize="medium")
    top.set_ylabel(f"share of the examples of steps {first}..k")
    styles = [Line2D([], [], color="grey", lw=3.0, alpha=0.45), Line2D([], [], color="grey", lw=1.1, ls="--")]
    handles, labels = top.get_legend_handles_labels()
    top.legend(handles + styles, labels + ["realized", "target"], ncol=1 + len(labels) // 16, **_LEGEND)
    bottom.set_ylabel("|count - weight × n|\n(from the stage start)")
    bottom.set_xlabel("global step k")
    bottom.set_ylim(-0.08, 2.2)   # a dataset on zero deviation stays in view
    bottom.legend(ncol=1 + len(groups) // 12, markerscale=1 if every_step else 6, **_LEGEND)
    bottom.xaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    save_png(figure, path)
