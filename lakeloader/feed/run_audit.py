"""The mixture a run realized, revision by revision and in total: what ``lakeloader audit
--state`` reports for a run continued under edited configs."""

from __future__ import annotations

import numpy as np
import pandas as pd

from lakeloader.catalog.audit import closed_form_proportions
from lakeloader.catalog.sql import example_token_means
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.feed.loader import Loader

RUN_AUDIT_COLUMNS = ["revision", "first_step", "stop_step", "dataset", "target_weight", "share", "examples",
                     "tokens", "epochs", "max_deviation", "first_index", "end_index"]


def run_audit(loader: Loader, stop: int) -> pd.DataFrame:
    """One row per (revision, dataset) of the run ``loader`` follows over steps ``[0, stop)``:
    each revision's steps (from its start to the next revision's, within the range), then the
    whole run (``revision`` "all"). ``target_weight``, ``share``, ``examples``, ``max_deviation``
    (counted from the start of each stage) and ``[first_index, end_index)`` as ``audit`` gives
    them; ``tokens``: the examples times the dataset's mean non-padding tokens per example;
    ``epochs``: how many of the dataset's epochs those examples make. Needs the complete lake."""
    if stop < 1:
        raise LakeloaderError(f"a run's audit needs at least one step, got steps [0, {stop})")
    run = loader.run
    with loader.view.reading() as cursor:
        means = example_token_means(cursor, {d.name: d.plan_key for d in loader.datasets}, loader.config.loader.seq_len)
    per_epoch = {d.name: d.train_count() for d in loader.datasets}
    starts = [r for r in run.revisions if r < stop]
    bounds = [*zip(starts, [*starts[1:], stop])]
    parts = [(str(number), a, b) for number, (a, b) in enumerate(bounds)] + [("all", 0, stop)]
    frames = []
    for revision, first, last in parts:
        frame = closed_form_proportions(run.spec, first, last)
        frame.insert(0, "revision", revision)
        frame.insert(1, "first_step", first)
        frame.insert(2, "stop_step", last)
        frame["examples"] = frame["examples"].astype(np.int64)
        frame["tokens"] = np.round(frame["examples"] * frame["dataset"].map(means)).astype(np.int64)
        frame["epochs"] = frame["examples"] / frame["dataset"].map(per_epoch)
        frames.append(frame[RUN_AUDIT_COLUMNS])
    found = pd.concat(frames, ignore_index=True)
    found.attrs.update(revisions=list(run.revisions), stop_step=stop, batch_size=run.spec.batch_size)
    return found
