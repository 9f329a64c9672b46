"""Audit a mixture: realized vs target proportions over a range of global steps.

Step ranges are half-open, ``[first, stop)``, as ``--steps A:B`` of the command line and the
catalog macros ``mixture_plan(id, first_step, stop_step)`` and ``mixture_proportions``.

The schedule is closed form (:func:`lakeloader.index.mixture.schedule`, the same computation the
loader's batches come from), so an audit never reads data.
When a build has registered the config's mixture in the catalog, the numbers come from the
catalog's SQL (macros ``mixture_plan`` and ``mixture_proportions`` of ``catalog/views.sql``);
otherwise from the same closed form in Python. Both give the same integers, bit for bit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import duckdb
import numpy as np
import pandas as pd

from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.sql import TOKEN_WEIGHTS_NEED, example_token_means, query
from lakeloader.config import Config, load_config
from lakeloader.contracts.errors import CatalogError, LakeloaderError
from lakeloader.contracts.specs import MixtureSpec, PackingSpec
from lakeloader.index.mixture import Mixer, Schedule, quantized_weights
from lakeloader.plan.selection import SelectionTask, evaluate_selection
from lakeloader.index.image_tokens import image_token_counts
from lakeloader.specs import (
    dataset_names,
    image_resolution,
    mixture_spec,
    packing_specs,
    plan_keys,
    stores_images,
    token_weights,
)

__all__ = ["audit", "closed_form_plan", "closed_form_proportions", "mixture_plan", "registered",
           "share_curves"]

AUDIT_COLUMNS = ["dataset", "target_weight", "share", "token_share", "examples", "tokens",
                 "max_deviation", "first_index", "end_index"]
IMAGE_COLUMNS = ["images", "image_token_share"]   # only for configs with stored images
_BLOCK = 65_536  # steps per block of the Python closed form


def _check_steps(first: int, stop: int) -> tuple[int, int]:
    """``(first, last)``: the first and the last step of the half-open range ``[first, stop)``."""
    if int(first) != first or int(stop) != stop or not 0 <= first < stop:
        raise LakeloaderError(
            f"audit needs steps 0 <= first < stop (the half-open range [first, stop)), got "
            f"first={first!r}, stop={stop!r}")
    return int(first), int(stop) - 1


def _blocks(mixer: Mixer, first: int, last: int) -> Iterator[Schedule]:
    """The schedule of steps ``first..last`` in blocks of at most ``_BLOCK`` steps."""
    for lo in range(first, last + 1, _BLOCK):
        yield mixer.schedule(np.arange(lo, min(lo + _BLOCK, last + 1), dtype=np.int64))


def _plan_frame(mixer: MixtureSpec, block: Schedule) -> pd.DataFrame:
    """Rows of ``mixture_plan`` of a schedule block: one per (step, dataset)."""
    steps, datasets = len(block.steps), len(mixer.names)
    return pd.DataFrame({
        "step": np.repeat(block.steps, datasets),
        "stage": np.repeat(block.stage, datasets).astype(np.int32),
        "dataset": np.tile(np.array(mixer.names, dtype=object), steps),
        "dataset_index": np.tile(np.arange(datasets, dtype=np.int32), steps),
        "examples": (block.after - block.before).reshape(-1),
        "before": block.before.reshape(-1),
        "after": block.after.reshape(-1),
        "stage_before": block.stage_before.reshape(-1),
        "stage_after": block.stage_after.reshape(-1),
        "stage_examples": np.repeat(block.stage_examples, datasets),
        "target_weight": block.target_weight.reshape(-1),
        "deviation": block.deviation.reshape(-1),
    })


def closed_form_plan(spec: MixtureSpec, first: int, stop: int) -> pd.DataFrame:
    """The rows of the catalog macro ``mixture_plan`` for steps ``[first, stop)``, computed in
    Python with :func:`lakeloader.index.mixture.schedule`: one row per (step, dataset)."""
    first, last = _check_steps(first, stop)
    mixer = Mixer.of(spec)
    return pd.concat([_plan_frame(mixer, block) for block in _blocks(mixer, first, last)],
                     ignore_index=True)


def closed_form_proportions(spec: MixtureSpec, first: int, stop: int) -> pd.DataFrame:
    """The rows of the catalog macro ``mixture_proportions`` for steps ``[first, stop)``, computed
    in Python (in blocks, so long ranges need little memory): one row per dataset. Integers and
    ``share``/``max_deviation`` equal the macro's bit for bit; the mean target is summed in
    another order, so it agrees to rounding."""
    first, last = _check_steps(first, stop)
    mixer = Mixer.of(spec)
    target = np.zeros(len(mixer.names))
    deviation = np.zeros(len(mixer.names))
    first_index = end_index = None
    for block in _blocks(mixer, first, last):
        if first_index is None:
            first_index = block.before[0]
        end_index = block.after[-1]
        target += block.target_weight.sum(axis=0)
        deviation = np.maximum(deviation, block.deviation.max(axis=0))
    examples = end_index - first_index
    return pd.DataFrame({
        "dataset": list(mixer.names),
        "target_weight": target / (last - first + 1),
        "examples": examples,
        "share": examples / examples.sum(),
        "first_index": first_index,
        "end_index": end_index,
        "max_deviation": deviation,
    })


def _mean_target(mixer: MixtureSpec, first: int, steps: np.ndarray) -> np.ndarray:
    """Target share of each dataset over steps ``first..k`` for each ``k`` in ``steps``: the mean
    of the stages' (quantised) weights weighted by their steps in the range, ``[len(steps), D]``."""
    total = np.zeros((len(steps), len(mixer.names)))
    ends = [s.start_step for s in mixer.stages[1:]] + [None]
    for stage, end in zip(mixer.stages, ends):
        quanta = np.array(quantized_weights(stage.weights), np.int64)
        last = steps if end is None else np.minimum(steps, end - 1)
        inside = np.maximum(last - max(first, stage.start_step) + 1, 0)
        total += inside[:, None] * (quanta / quanta.sum())[None, :]
    return total / (steps - first + 1)[:, None]


def registered(con: duckdb.DuckDBPyConnection, mixture_id: str) -> bool:
    """Whether the catalog behind ``con`` holds mixture ``mixture_id`` (registered by a build)."""
    try:
        return bool(con.execute(query("mixture_registered"), {"mixture_id": mixture_id}).fetchone()[0])
    except duckdb.CatalogException:
        return False  # a catalog from before mixtures were registered


@contextlib.contextmanager
def _connection(config: Config) -> Iterator[duckdb.DuckDBPyConnection | None]:
    """The one read-only connection to the lake's catalog an audit uses (None: no lake yet, the
    closed form needs none), closed at the end."""
    lake = open_lake(config)
    try:
        con = lake.connect()
    except (CatalogError, OSError):
        yield None
        return
    try:
        yield con
    except duckdb.Error as exc:
        raise lake.catalog_damage(exc) or exc
    finally:
        con.close()


def _holds(con: duckdb.DuckDBPyConnection | None, mixer: MixtureSpec) -> bool:
    """Whether the catalog behind ``con`` holds ``mixer``'s schedule."""
    return con is not None and registered(con, mixer.mixture_id)


def _packing(config: Config, con: duckdb.DuckDBPyConnection) -> dict[str, PackingSpec]:
    return packing_specs(config, open_lake(config).tokenizer(con, dataset_names(config)))


def _lake_means(config: Config, con: duckdb.DuckDBPyConnection | None) -> tuple[Mixer, dict[str, float]]:
    """The config's mixer (weights in tokens converted with the lake's catalog ``con``) and each
    dataset's mean non-padding tokens per example (``seq_len`` under concat)."""
    names = dataset_names(config)
    if config.loader.packing == "concat" and not token_weights(config):
        return Mixer.of(mixture_spec(config)), {n: float(config.loader.seq_len) for n in names}
    if con is None:
        open_lake(config).connect().close()   # raises what is wrong with the lake
        raise CatalogError(f"no catalog for lake {config.lake}: build it first (lakeloader build CONFIG)")
    plans = plan_keys(config, _packing(config, con))
    needed_by = (TOKEN_WEIGHTS_NEED if token_weights(config) else
                 (f"the audit's token shares under packing: {config.loader.packing}", "then audit again"))
    means = example_token_means(con, plans, config.loader.seq_len, needed_by)
    return Mixer.of(mixture_spec(config, means)), means


def check_selections(config: Config, con: duckdb.DuckDBPyConnection) -> int:
    """Evaluate the predicate of every dataset of the config's mixture defined by a filter afresh
    on each of its committed chunks (reading the source chunk files' metadata) and compare with
    the catalog: documents, tokens and parts of the chunk and of each row group, the selection,
    and the examples under the loader's packing plan. Returns the chunks checked; a
    LakeloaderError names the first dataset, chunk and count that differ."""
    lake = open_lake(config)
    filtered = [name for name in dataset_names(config) if config.datasets[name].from_ is not None]
    specs = _packing(config, con) if filtered and config.loader.packing != "concat" else {}
    checked = 0
    for name in filtered:
        spec = specs.get(name)
        rows = con.execute(query("audit_filtered_chunks"),
                           {"name": name, "plan_key": spec.plan_key if spec else ""}).df()
        for row in rows.itertuples(index=False):
            fresh = evaluate_selection(SelectionTask(
                dataset=name, source=row.source_dataset, global_index=int(row.global_index),
                where=config.datasets[name].where or "", chunk_url=lake.url_of(row.path),
                num_bytes=int(row.num_bytes), checksum=row.checksum, num_records=int(row.num_records),
                kinds=len(config.datasets[name].part_kinds), storage_options=config.storage_options,
                packing=(spec,) if spec else (), source_file=row.source,
                line_base=None if pd.isna(row.line_base) else int(row.line_base)))
            stored_selection = [(int(first), list(docs)) for _, first, docs in con.execute(
                query("chunk_selection"), {"name": name, "global_index": int(row.global_index)}).fetchall()]
            pairs = {
                "num_docs": (int(row.num_docs), fresh.num_docs),
                "num_tokens": (int(row.num_tokens), fresh.num_tokens),
                "num_parts": (_listed(row.num_parts), [sum(c) for c in zip(*fresh.row_group_parts)]),
                "part_tokens": (_listed(row.part_tokens), [sum(c) for c in zip(*fresh.row_group_part_tokens)]),
                "row group documents": (_listed(row.row_group_docs), fresh.row_group_docs),
                "row group tokens": (_listed(row.row_group_tokens), fresh.row_group_tokens),
                "selection": (stored_selection, [(first, docs) for first, docs in fresh.selection or ()]),
            }
            if spec is not None:
                pairs["examples"] = (_listed(row.examples), [p.num_examples for p in fresh.plans])
            for what, (stored, expected) in pairs.items():
                if _plain(stored) != _plain(expected):
                    raise LakeloaderError(
                        f"dataset {name!r}, chunk {row.global_index}: the catalog's {what} "
                        f"({_short(stored)}) differs from a fresh evaluation of datasets.{name}.where over "
                        f"chunk {row.global_index} of dataset {row.source_dataset!r} ({_short(expected)}): the "
                        "catalog was altered or built with another predicate; build the lake again "
                        "(lakeloader build CONFIG) into a new lake")
            checked += 1
    return checked


def _listed(value: object) -> list[object]:
    """A LIST column's value as a list (NULL: empty)."""
    return [] if value is None or (isinstance(value, float) and np.isnan(value)) else list(value)  # type: ignore[call-overload]


def _plain(value: object) -> object:
    """Numbers and nested lists of them (numpy's included) as Python ints and lists."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(item) for item in value]
    return int(value)  # type: ignore[call-overload]


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def mixture_plan(config: Config | str | os.PathLike[str], first: int, stop: int) -> pd.DataFrame:
    """One row per (step, dataset) of steps ``[first, stop)`` (``stop`` excluded): the dataset's
    examples in the step's batch, the stream indices ``[before, after)`` that fed it, the counts
    from the start of the step's stage, the target weight and the deviation from it (columns as
    the catalog macro ``mixture_plan``). Read from the catalog when the mixture is registered
    (``frame.attrs["source"] == "catalog"``), else from the closed form."""
    config = load_config(config)
    first, last = _check_steps(first, stop)
    with _connection(config) as con:
        mixer = _lake_means(config, con)[0]
        frame = _plan_rows(con, mixer, first, last)
    frame.attrs["mixture_id"] = mixer.mixture_id
    return frame


def _plan_rows(con: duckdb.DuckDBPyConnection | None, mixer: Mixer, first: int, last: int) -> pd.DataFrame:
    """The rows of ``mixture_plan`` for steps ``first..last``: from the catalog behind ``con`` when
    it holds ``mixer`` (``attrs["source"] == "catalog"``), else from the closed form."""
    if con is None or not _holds(con, mixer):
        frame = closed_form_plan(mixer, first, last + 1)
        frame.attrs["source"] = "closed form"
    else:
        frame = con.execute(query("mixture_plan_rows"),
                            {"mixture_id": mixer.mixture_id, "first": first, "stop": last + 1}).df()
        frame.attrs["source"] = "catalog"
    return frame


def _image_figures(config: Config) -> list[str]:
    """The mixture's datasets that store their images (the audit then counts them)."""
    return [name for name in dataset_names(config) if stores_images(config.datasets[name])]


def _dataset_images(config: Config, con: duckdb.DuckDBPyConnection, name: str) -> tuple[int, float, int]:
    """(images, image tokens' share of the rendered non-padding tokens, examples) of dataset
    ``name`` over the lake under the config's packing plan: each image's placeholders (its
    resolution's count from its stored size) and its two boundary tokens."""
    sizes = con.execute(query("image_sizes"), {"name": name}).fetchnumpy()
    dataset = config.datasets[name]
    counts = image_token_counts(sizes["width"], sizes["height"], image_resolution(dataset),
                                dataset.interleaved.image_tokens)
    plan = plan_keys(config, _packing(config, con))[name]
    tokens, examples, _, _ = con.execute(query("plan_example_tokens"), {"name": name, "plan_key": plan}).fetchone()
    return len(counts), float((counts.sum() + 2 * len(counts)) / max(tokens, 1)), max(int(examples), 1)


def audit(config: Config | str | os.PathLike[str], first: int, stop: int) -> pd.DataFrame:
    """Realized vs target proportions of the config's mixture over global steps ``[first, stop)``
    (``stop`` excluded, as ``--steps A:B``), one row per dataset:

    - ``target_weight``: the stage's weight; over steps of several stages, the mean of the
      stages' weights weighted by their examples in the range;
    - ``share``: the dataset's share of the examples of those steps (``examples`` of them);
    - ``token_share``: its share of their non-padding tokens (``tokens``). With ``packing:
      concat`` every training example has exactly ``seq_len`` of them, so this equals ``share``;
      with ``pack``/``pad`` it is the examples times the dataset's mean non-padding tokens per
      example under the loader's packing plan (from the catalog's ``chunk_examples``);
    - ``max_deviation``: the largest ``|count_d(n) - w_d * n|`` over the whole-batch prefixes
      ending at each step of the range, counted from the start of the step's stage (what the
      schedule keeps below 2);
    - ``first_index``, ``end_index``: the dataset's stream indices ``[first_index, end_index)``
      that fed the range (example ``i % N_d`` of epoch ``i // N_d`` of a dataset of ``N_d``).

    The numbers come from the catalog's ``mixture_proportions`` macro when a build registered
    the mixture (``frame.attrs["source"] == "catalog"``), else from the closed form in Python
    (``"closed form"``); both agree. A config without a ``mixture`` section audits its single
    dataset at share 1.0. The datasets defined by a filter are checked against a fresh
    evaluation of their predicate (:func:`check_selections`; ``frame.attrs["selections_checked"]``
    chunks), a LakeloaderError if the catalog differs. One catalog connection is opened.
    Datasets storing their images add ``images`` (the range's examples times the dataset's
    images per example) and ``image_token_share`` (the share of the dataset's rendered tokens
    that are its images' placeholder runs, with their boundary tokens).
    """
    config = load_config(config)
    first, last = _check_steps(first, stop)
    with _connection(config) as con:
        mixer, means = _lake_means(config, con)
        checked = 0 if con is None else check_selections(config, con)
        if con is None or not _holds(con, mixer):
            frame = closed_form_proportions(mixer, first, last + 1)
            source = "closed form"
        else:
            frame = con.execute(query("mixture_proportions"), {
                "mixture_id": mixer.mixture_id, "first_step": first, "stop_step": last + 1}).df()
            source = "catalog"
        figures = {} if con is None else {name: _dataset_images(config, con, name) for name in _image_figures(config)}
    seq_len = config.loader.seq_len
    frame["examples"] = frame["examples"].astype(np.int64)
    frame["tokens"] = np.round(frame["examples"] * frame["dataset"].map(means)).astype(np.int64)
    frame["token_share"] = frame["tokens"] / frame["tokens"].sum()
    columns = AUDIT_COLUMNS
    if figures:
        per_example = {name: images / examples for name, (images, _, examples) in figures.items()}
        frame["images"] = np.round(frame["examples"] * frame["dataset"].map(per_example).fillna(0)).astype(np.int64)
        frame["image_token_share"] = frame["dataset"].map({n: f[1] for n, f in figures.items()}).fillna(0.0)
        columns = AUDIT_COLUMNS + IMAGE_COLUMNS
    frame = frame[columns].reset_index(drop=True)
    frame.attrs.update(source=source, mixture_id=mixer.mixture_id, first_step=first, stop_step=last + 1,
                       batch_size=mixer.batch_size, seq_len=seq_len, selections_checked=checked)
    return frame


def share_curves(config: Config | str | os.PathLike[str], first: int, stop: int, *,
                 max_steps: int = 20_000) -> pd.DataFrame:
    """The realized and the target share of each dataset of the config's mixture over steps
    ``[first, stop)``, step by step (what ``lakeloader audit --plot`` draws): one row per (step
    ``k``, dataset) in step order, the datasets in the mixture's order, with

    - ``share``: the dataset's share of the examples of steps ``first..k``;
    - ``target_share``: its target over the same steps (the mean of the stages' weights weighted
      by their steps among them);
    - ``deviation``: ``|count - weight * n|`` of step ``k``, counted from the start of its stage
      (what the schedule keeps below 2).

    Ranges longer than ``max_steps`` give ``max_steps`` evenly spaced steps (the first and the
    last included), each exact, from the closed form. ``attrs``: ``mixture_id``, ``batch_size``,
    ``first_step``, ``stop_step``, ``source`` (as :func:`mixture_plan`'s, or the closed form at
    the steps picked) and ``stage_starts`` (stage number: its first step, for each stage that
    starts inside the range after ``first``). Reads no data.
    """
    config = load_config(config)
    first, last = _check_steps(first, stop)
    with _connection(config) as con:
        mixer = _lake_means(config, con)[0]
        if last - first + 1 <= max_steps:
            plan = _plan_rows(con, mixer, first, last)
            source = plan.attrs["source"]
        else:  # evenly spaced steps, each exact (the closed form seeks at no cost)
            picks = np.unique(np.linspace(first, last, max_steps).round().astype(np.int64))
            plan = _plan_frame(mixer, mixer.schedule(picks))
            source = f"closed form at {len(picks):,} evenly spaced steps"
    plan = plan.sort_values(["step", "dataset_index"], ignore_index=True)
    steps = plan["step"].to_numpy()[:: len(mixer.names)]
    after = plan["after"].to_numpy().reshape(len(steps), len(mixer.names))
    start = plan["before"].to_numpy()[: len(mixer.names)]   # the stream indices at step first
    frame = pd.DataFrame({
        "step": plan["step"].to_numpy(),
        "dataset": plan["dataset"].to_numpy(),
        "share": ((after - start) / ((steps - first + 1) * mixer.batch_size)[:, None]).reshape(-1),
        "target_share": _mean_target(mixer, first, steps).reshape(-1),
        "deviation": plan["deviation"].to_numpy(),
    })
    frame.attrs.update(mixture_id=mixer.mixture_id, batch_size=mixer.batch_size, first_step=first,
                       stop_step=last + 1, source=source,
                       stage_starts={number: stage.start_step for number, stage in enumerate(mixer.stages)
                                     if first < stage.start_step <= last})
    return frame
