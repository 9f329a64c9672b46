"""A run's segments: the mixture it realized between the steps where its config was revised, and
in total (what ``lakeloader audit --state`` reports for a run continued under edited configs).

The table lives with the run, not in the lake: it is computed from the state (the run's mixture
in closed form) and the lake's per-chunk counts, reads no data and writes nothing, so any reader
of a published snapshot can answer it (``--format json`` for other tools, a DataFrame in Python).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from lakeloader.catalog.audit import closed_form_proportions
from lakeloader.catalog.sql import example_token_means
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.feed.loader import Loader

RUN_SEGMENT_COLUMNS = ["segment", "first_step", "stop_step", "dataset", "target_weight", "share", "examples",
                       "tokens", "epochs", "first_epoch", "last_epoch", "max_deviation", "first_index", "end_index"]


def _epochs(loader: Loader, name: str, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The epoch of each of dataset ``name``'s stream positions, and the epochs elapsed before it
    (float), over the epochs the run gave it (those of a dataset grown during the run included)."""
    sizes = loader.run.sizes(name)
    if sizes is not None:
        return sizes.locate(positions).epoch, sizes.progress(positions)
    per_epoch = loader.datasets[loader.dataset_names.index(name)].train_count()
    return positions // per_epoch, positions / per_epoch


def run_segments(loader: Loader, stop: int) -> pd.DataFrame:
    """The ``run_segments`` table: one row per (segment, dataset) of the run ``loader`` follows
    over steps ``[0, stop)``: each segment's steps (from a revision to the next, within the
    range), then the whole run (``segment`` "all"). ``target_weight``, ``share``, ``examples``,
    ``max_deviation`` (counted from the start of each stage) and the stream positions
    ``[first_index, end_index)`` as ``audit`` gives them; ``tokens``: the examples times the
    dataset's mean non-padding tokens per example (exact under ``packing: concat``, where every
    example has ``seq_len``); ``epochs``: how many of the dataset's epochs those examples make;
    ``first_epoch`` and ``last_epoch``: the epochs of the first and last of them (-1 for none).
    Needs the complete lake."""
    if stop < 1:
        raise LakeloaderError(f"a run's segments need at least one step, got steps [0, {stop})")
    run = loader.run
    with loader.view.reading() as cursor:
        means = example_token_means(cursor, {d.name: d.plan_key for d in loader.datasets}, loader.config.loader.seq_len)
    starts = [r for r in run.revisions if r < stop]
    bounds = [*zip(starts, [*starts[1:], stop])]
    parts = [(str(number), a, b) for number, (a, b) in enumerate(bounds)] + [("all", 0, stop)]
    frames = []
    for segment, first, last in parts:
        frame = closed_form_proportions(run.spec, first, last)
        frame.insert(0, "segment", segment)
        frame.insert(1, "first_step", first)
        frame.insert(2, "stop_step", last)
        frame["examples"] = frame["examples"].astype(np.int64)
        frame["tokens"] = np.round(frame["examples"] * frame["dataset"].map(means)).astype(np.int64)
        # Per dataset: the epochs of its first and last example and the epochs elapsed at either end.
        found = [_epochs(loader, name, np.array([a, max(a, b - 1), b], np.int64))
                 for name, a, b in zip(frame["dataset"], frame["first_index"], frame["end_index"])]
        drawn = frame["examples"].to_numpy() > 0
        frame["epochs"] = [progress[2] - progress[0] for _, progress in found]
        frame["first_epoch"] = np.where(drawn, [epoch[0] for epoch, _ in found], -1).astype(np.int64)
        frame["last_epoch"] = np.where(drawn, [epoch[1] for epoch, _ in found], -1).astype(np.int64)
        frames.append(frame[RUN_SEGMENT_COLUMNS])
    table = pd.concat(frames, ignore_index=True)
    table.attrs.update(revisions=list(run.revisions), stop_step=stop, batch_size=run.spec.batch_size)
    return table
