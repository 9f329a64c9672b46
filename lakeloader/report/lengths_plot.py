"""The figure of a lake's document lengths: a log-binned histogram per dataset."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from lakeloader.catalog.documents import HISTOGRAM_BINS_PER_OCTAVE
from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.config import Config
from lakeloader.contracts.errors import CatalogError
from lakeloader.report.canvas import new_figure, save_png

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def plot_lengths(lake: Lake | Config | str | os.PathLike[str], path: str | os.PathLike[str],
                 by: str | None = None, *, whole_lake: bool = False, max_values: int = 8) -> pd.DataFrame:
    """Write a PNG of document lengths to ``path`` and return the ``Lake.stats(by, whole_lake)``
    it summarises. ``lake``: a Lake, or a config or lake path/URL to open. One panel per dataset
    (of the config's datasets, or the whole lake's with ``whole_lake``), documents per
    quarter-octave bin over a log-scaled length axis and the median marked; with ``by``, one curve
    per value of that column of the documents view (the ``max_values`` most frequent). Needs
    matplotlib (a LakeloaderError says so)."""
    figure = new_figure("document lengths")
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    lake = lake if isinstance(lake, Lake) else open_lake(lake)
    stats, histogram = lake.document_lengths(by, whole_lake)
    datasets = sorted(histogram["dataset"].unique())
    if not datasets:
        raise CatalogError("the lake has no committed documents to plot: build it first")
    figure.set_size_inches(9.0, 0.6 + 2.6 * len(datasets))
    axes = figure.subplots(len(datasets), 1, squeeze=False)[:, 0]
    for ax, name in zip(axes, datasets):
        rows = histogram[histogram["dataset"] == name]
        totals = stats[stats["dataset"] == name]
        if by is None:
            _stairs(ax, rows, None)
            p50 = int(totals["p50"].iloc[0])
            ax.axvline(p50, color="black", linestyle="--", linewidth=1, label=f"median {p50:,}")
            title = None
        else:
            values = rows.groupby("value", dropna=False)["documents"].sum().sort_values(ascending=False)
            for value in values.index[:max_values]:
                chosen = rows["value"].isna() if pd.isna(value) else rows["value"] == value
                _stairs(ax, rows[chosen], f"{by} is null" if pd.isna(value) else f"{by} = {value}")
            more = len(values) - max_values
            title = f"{more} more value{'s' if more > 1 else ''}\nnot shown" if more > 0 else None
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small", title=title)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{name}: {int(totals['documents'].sum()):,} documents, "
                     f"{int(totals['tokens'].sum()):,} tokens", fontsize="medium")
        ax.set_xlabel("document length (tokens, log scale)")
        ax.set_ylabel("documents")
        ax.grid(alpha=0.3)
    save_png(figure, path)
    return stats


def _stairs(ax: Axes, rows: pd.DataFrame, label: str | None) -> None:
    """Documents per log-spaced bin of ``rows``: filled bars alone (``label`` None), or a step
    curve among several."""
    if rows.empty:
        return
    bins, counts = rows["bin"].to_numpy(), rows["documents"].to_numpy()
    full = np.arange(bins.min(), bins.max() + 2)   # every bin in the range (empty ones too), then the end
    dense = np.zeros(len(full) - 1)
    dense[bins - bins.min()] = counts
    edges = 2.0 ** (full / HISTOGRAM_BINS_PER_OCTAVE)
    if label is None:
        ax.stairs(dense, edges, fill=True, color="tab:blue", alpha=0.8)
    else:
        ax.stairs(dense, edges, label=label, linewidth=1.5)
