"""What a loader reads, decided from its config and arguments before any I/O: every check of a
loader's combination of config, mode and process layout lives here (the config model checks
each key alone)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lakeloader.config import Config, ShuffleConfig
from lakeloader.contracts.errors import ConfigError, LakeloaderError
from lakeloader.specs import dataset_names, stores_images


@dataclasses.dataclass(frozen=True)
class LoaderSettings:
    """A loader's checked settings: which rows of each global batch it builds, in which mode,
    ordering and shuffle, over which datasets (in ``dataset_ids`` order)."""

    mode: str                   # train | eval
    process_index: int
    process_count: int
    row_indices: np.ndarray     # int64: global row numbers (within each batch) this process builds
    ordering: str               # global | strided (evaluation reads in the global order)
    shuffle: ShuffleConfig      # (evaluation reads unshuffled)
    names: tuple[str, ...]      # the datasets the mixture draws from


def loader_settings(config: Config, *, mode: str = "train", process_index: int = 0, process_count: int = 1,
                    rows: Sequence[int] | None = None) -> LoaderSettings:
    """The settings of a loader of ``config`` for process ``process_index`` of ``process_count``
    (``rows``: the global rows it owns instead of its contiguous block), or a LakeloaderError
    (a ConfigError for a config that cannot work) saying what to change."""
    loader = config.loader
    if process_count < 1 or not 0 <= process_index < process_count:
        raise LakeloaderError(f"process_index {process_index} must be in [0, process_count={process_count})")
    if rows is not None:
        row_indices = np.asarray(rows, dtype=np.int64)
        if not len(row_indices) or row_indices.min() < 0 or row_indices.max() >= loader.batch_size:
            raise LakeloaderError(f"rows must be a non-empty subset of [0, batch_size={loader.batch_size})")
    elif loader.batch_size % process_count:
        raise LakeloaderError(
            f"loader.batch_size {loader.batch_size} is not divisible by the process count "
            f"{process_count}: every process must get the same number of rows; choose a batch "
            "size that is a multiple of the process count")
    else:
        per_process = loader.batch_size // process_count
        row_indices = np.arange(process_index * per_process, (process_index + 1) * per_process)
    if mode not in ("train", "eval"):
        raise LakeloaderError(f"mode must be 'train' or 'eval', got {mode!r}")
    check_combination(config, mode)
    ordering = loader.ordering if mode == "train" else "global"
    shuffle = loader.shuffle if mode == "train" else ShuffleConfig()
    return LoaderSettings(mode, process_index, process_count, row_indices, ordering, shuffle, dataset_names(config))


def check_combination(config: Config, mode: str) -> None:
    """Raise a ConfigError for formats, packing modes and orderings that cannot work together."""
    loader = config.loader
    used = {name: config.datasets[name] for name in dataset_names(config)}
    seq2seq = [n for n, d in used.items() if d.seq2seq]
    for name, dataset in used.items():
        if loader.packing == "concat" and dataset.format == "interleaved":
            raise ConfigError(
                f"datasets.{name}.format = 'interleaved' needs loader.packing: pack or pad: concat spans "
                "are cut anywhere and would split an image's tokens")
        if loader.packing == "concat" and name in seq2seq:
            raise ConfigError(
                f"datasets.{name}.supervised.output = 'seq2seq' needs loader.packing: pack or pad (a "
                "span of a stream has no prompt/response sides)")
    resolutions = {name: d.interleaved.resolution for name, d in used.items() if stores_images(d)}
    if len({(r.model_dump_json(), used[n].interleaved.max_pixels) for n, r in resolutions.items()}) > 1:
        raise ConfigError(
            f"datasets {sorted(resolutions)} store their images but differ in interleaved.resolution or max_pixels: "
            "a batch's pixel fields have one shape; give them the same resolution")
    if seq2seq and len(seq2seq) != len(used):
        raise ConfigError(
            f"datasets {seq2seq} have supervised.output: seq2seq but others do not: a batch is either "
            "seq2seq (inputs and targets) or causal; mix them in separate loaders")
    if seq2seq and loader.pack.long_documents == "split":
        raise ConfigError(
            "loader.pack.long_documents = 'split' cannot cut seq2seq examples (a piece would lose its "
            "prompt); set it to truncate or error")
    if mode == "train" and loader.ordering == "strided":
        if loader.packing != "concat":
            raise ConfigError(
                f"loader.ordering = 'strided' needs loader.packing: concat (got {loader.packing!r}); use "
                "ordering: global")
        if loader.shuffle.kind != "none":
            raise ConfigError(
                f"loader.shuffle.kind = {loader.shuffle.kind!r} needs loader.ordering: global (the strided "
                "ordering fixes its own order); set shuffle to none or ordering to global")
