"""The loader: global batch ``b`` = examples ``[b*B, (b+1)*B)``; each process builds only its rows.

Loader state is ``{step, fingerprint}``: seeking to any step is index arithmetic and catalog
lookups, never a replay of data.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.sql import example_token_means
from lakeloader.catalog.store import LiveCatalog
from lakeloader.config import Config, ShuffleConfig, load_config
from lakeloader.contracts.errors import (
    CatalogNotPublishedError,
    ConfigError,
    LakeloaderError,
    StepRangeError,
)
from lakeloader.feed.concat_examples import DatasetExamples
from lakeloader.feed.explain import explain
from lakeloader.feed.packed_examples import PackedExamples
from lakeloader.feed.read_ahead import ReadAhead
from lakeloader.feed.rows import ArrayPool, ArraySource, Batch, Example, StepExamples, field_dtype, fill_batch
from lakeloader.feed.workers import worker_batches
from lakeloader.index.mixture import Mixer
from lakeloader.read.catalog_view import POLL_SECONDS, CatalogView
from lakeloader.read.chunks import ChunkFiles
from lakeloader.read.windows import StreamReader
from lakeloader.specs import dataset_names, mixture_spec, packing_spec, template_for, token_id, token_weights

log = logging.getLogger(__name__)

LOCATE_AHEAD = 8   # training steps whose examples are located together, once steps are asked in order


@dataclasses.dataclass(frozen=True)
class LocatedSteps:
    """Rows of training steps ``first`` to ``first + steps - 1`` of one process, assigned
    together (each step's rows back to back): their dataset numbers and example indices, and
    ``part(a, b)``, the examples of rows ``a`` to ``b`` when one dataset owns every row (its
    ``train_block``; None otherwise)."""

    first: int
    steps: int
    owners: np.ndarray
    indices: np.ndarray
    part: Callable[[int, int], Sequence[Example]] | None


def _sole_owner(owners: np.ndarray) -> int | None:
    """The dataset that owns every row of ``owners`` (non-empty); None when several do or a row
    is past an evaluation pass (-1)."""
    first = int(owners[0])
    return first if first >= 0 and bool((owners == first).all()) else None


@dataclasses.dataclass(frozen=True)
class LoaderState:
    """Everything needed to resume: the next step and the fingerprint of what defines batches."""

    step: int
    fingerprint: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (for checkpoints)."""
        return {"step": self.step, "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> LoaderState:
        """Inverse of :meth:`to_dict`."""
        return cls(int(state["step"]), str(state["fingerprint"]))


def check_combination(config: Config, mode: str) -> None:
    """Raise a ConfigError for formats and packing modes that cannot work together."""
    loader = config.loader
    used = {name: config.datasets[name] for name in dataset_names(config)}
    seq2seq = [n for n, d in used.items() if d.seq2seq]
    for name, dataset in used.items():
        if loader.packing == "concat" and dataset.format == "interleaved":
            raise ConfigError(
                f"datasets.{name}.format = 'interleaved' needs loader.packing: pack or pad: concat windows "
                "cut anywhere and would split an image's tokens")
        if loader.packing == "concat" and name in seq2seq:
            raise ConfigError(
                f"datasets.{name}.supervised.output = 'seq2seq' needs loader.packing: pack or pad (a "
                "window of a stream has no prompt/response sides)")
    if seq2seq and len(seq2seq) != len(used):
        raise ConfigError(
            f"datasets {seq2seq} have supervised.output: seq2seq but others do not: a batch is either "
            "seq2seq (inputs and targets) or causal; mix them in separate loaders")
    if seq2seq and loader.pack.long_documents == "split":
        raise ConfigError(
            "loader.pack.long_documents = 'split' cannot cut seq2seq examples (a piece would lose its "
            "prompt); set it to truncate or error")
    if loader.packing != "concat" and mode == "train" and loader.ordering == "strided":
        raise ConfigError(
            f"loader.ordering = 'strided' needs loader.packing: concat (got {loader.packing!r}); use "
            "ordering: global")


class Loader:
    """Deterministic global batches of a lake for process ``process_index`` of ``process_count``.

    ``mode="train"`` cycles the data forever, each epoch in its own order under a shuffle (the
    epoch is part of every permutation's key); ``mode="eval"`` is one finite pass in order with
    the last batch padded and masked. ``dataset_names`` are the datasets a batch's
    ``dataset_ids`` number, in that order.
    """

    def __init__(self, config: Config | str | os.PathLike[str], *, process_index: int = 0,
                 process_count: int = 1, mode: str = "train", rows: Sequence[int] | None = None,
                 catalog: LiveCatalog | None = None) -> None:
        """``rows`` (global row numbers within each batch) overrides the contiguous block of
        process ``process_index`` of ``process_count``, for shardings that own other rows.
        ``catalog``: the live-catalog handle of a build running in this process (the one given
        to ``build(config, live=...)``) to read its live catalog while it runs; without it the
        loader reads the published snapshot, as in any other process."""
        self.config = config = load_config(config)
        loader = config.loader
        if process_count < 1 or not 0 <= process_index < process_count:
            raise LakeloaderError(
                f"process_index {process_index} must be in [0, process_count={process_count})")
        if rows is not None:
            self.row_indices = np.asarray(rows, dtype=np.int64)
            if not len(self.row_indices) or self.row_indices.min() < 0 or self.row_indices.max() >= loader.batch_size:
                raise LakeloaderError(f"rows must be a non-empty subset of [0, batch_size={loader.batch_size})")
        elif loader.batch_size % process_count:
            raise LakeloaderError(
                f"loader.batch_size {loader.batch_size} is not divisible by the process count "
                f"{process_count}: every process must get the same number of rows; choose a batch "
                "size that is a multiple of the process count")
        else:
            per_process = loader.batch_size // process_count
            self.row_indices = np.arange(process_index * per_process, (process_index + 1) * per_process)
        self.rows = len(self.row_indices)
        if mode not in ("train", "eval"):
            raise LakeloaderError(f"mode must be 'train' or 'eval', got {mode!r}")
        check_combination(config, mode)
        self.mode = mode
        self.process_index, self.process_count = process_index, process_count
        self.lake = Lake(config.lake, config.storage_options)
        self.view = CatalogView(self.lake, config.io_retry_deadline, live=catalog)
        self.files = ChunkFiles(self.lake, loader.verify, loader.cache_bytes, loader.disk_cache_bytes,
                                config.io_retry_deadline, view=self.view)
        self.dataset_names = names = dataset_names(config)
        self.view.check_own_plans(config, names)   # the lake's plan of each name is this config's definition
        self.tokenizer = self.lake.tokenizer_at(self.view.tokenizer_path(names), names)
        self.pad_id = token_id(self.tokenizer, "loader.pad_token", loader.pad_token or loader.eos_token)
        self.templates = {name: template_for(name, config, self.tokenizer) for name in names}
        ordering = loader.ordering if mode == "train" else "global"
        shuffle = loader.shuffle if mode == "train" else ShuffleConfig()
        if ordering == "strided" and shuffle.kind != "none":
            raise ConfigError(
                f"loader.shuffle.kind = {shuffle.kind!r} needs loader.ordering: global (the strided "
                "ordering fixes its own order); set shuffle to none or ordering to global")
        self.datasets = [self._examples(name, ordering, shuffle) for name in names]
        means = None
        if token_weights(config):
            for examples in self.datasets:   # the weights need every dataset's mean example size
                examples.complete_chunks()
            with self.view.reading() as cursor:
                means = example_token_means(cursor, {d.name: d.plan_key for d in self.datasets}, loader.seq_len)
        self.mixer = Mixer.of(mixture_spec(config, means))
        self.fingerprint = self._fingerprint()
        self._iterators: weakref.WeakSet[Iterator[Batch]] = weakref.WeakSet()
        self._num_batches: tuple[int | None] | None = None   # once computed (None is a count too)
        self._arrays = ArrayPool()
        self._located: LocatedSteps | None = None   # the training steps last located together
        # Training rows are written whole (concat windows; packed examples with their padding).
        self._whole_rows = mode == "train" and all(d.fills_whole_rows for d in self.datasets)
        # The fields beyond the row fields that every batch has (the mixture's datasets say which).
        mixed = [config.datasets[name] for name in self.mixer.names]
        self._seq2seq = any(d.seq2seq for d in mixed)
        self._max_images = max((d.interleaved.max_images for d in mixed if d.format == "interleaved"), default=0)

    def _warn_if_beyond_the_cache(self) -> None:
        """Warn when a full shuffle reads datasets much larger than the row-group cache: nearly
        every example then reads a row group no longer cached (from the pages its window needs)."""
        stored = sum(d.chunks.stored_bytes for d in self.datasets)
        cache = self.config.loader.cache_bytes
        if stored > 2 * cache:
            log.warning(
                "loader.shuffle.kind: full over %.1f GB of stored tokens with loader.cache_bytes %.2f GB: most "
                "examples land in a row group no longer cached (build.row_group_tokens: %d tokens) and read it "
                "again, from the pages their window needs, a few M tokens/s. For a lake much larger than the "
                "cache use loader.shuffle.kind block or window, or raise loader.cache_bytes towards the lake's size",
                stored / 1e9, cache / 1e9, self.config.build.row_group_tokens)

    def _examples(self, name: str, ordering: str, shuffle: ShuffleConfig) -> DatasetExamples:
        loader, dataset = self.config.loader, self.config.datasets[name]
        reader = StreamReader(self.view, self.files, self.templates[name], scattered=shuffle.kind == "full",
                              sequential=shuffle.kind == "none" and ordering == "global")
        common: dict[str, Any] = dict(seq_len=loader.seq_len, ordering=ordering, ideal_readers=loader.ideal_readers,
                                      wait_timeout=loader.wait_timeout, shuffle=shuffle, seed=loader.seed)
        spec = packing_spec(name, self.config, self.templates[name])
        if spec is None:
            return DatasetExamples(name, self.view, reader, **common)
        return PackedExamples(name, self.view, reader, spec, seq2seq=dataset.seq2seq, pad_id=self.pad_id,
                              **common)

    def _fingerprint(self) -> str:
        loader = self.config.loader
        payload = {
            "datasets": {d.name: d.fingerprint for d in self.datasets},
            "mixture": self.config.mixture.model_dump() if self.config.mixture else None,
            "loader": loader.model_dump(
                exclude={"wait_timeout", "prefetch", "workers", "verify", "cache_bytes", "disk_cache_bytes", "fields"}),
            "templates": {name: t.fingerprint for name, t in self.templates.items()},
            "pad": self.pad_id,
            "mode": self.mode,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]

    # -- sizes -----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the lake's tokenizer, special tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def num_batches(self) -> int | None:
        """Batches of an evaluation pass, or of training under a stop strategy (the same on every
        process); None when training cycles forever. A count needs every dataset complete: while
        the lake is being built this waits for the build (``loader.wait_timeout`` per chunk at
        most). Computed once."""
        if self._num_batches is None:
            if self.mode == "train":
                self._num_batches = (self.mixer.stop_step([d.train_count() for d in self.datasets])
                                     if self.mixer.finite else None,)
            else:
                total = self.mixer.eval_total([d.eval_count() for d in self.datasets])
                self._num_batches = (-(-total // self.config.loader.batch_size),)
        return self._num_batches[0]

    # -- batches ---------------------------------------------------------------------------------

    def _windows(self, step: int) -> tuple[np.ndarray, Sequence[Example | None]]:
        """Each local row's dataset number (-1: past an eval pass) and example of batch ``step``
        (a dataset's :class:`~lakeloader.feed.rows.ExampleRun` as it is when it has every row)."""
        if self.mode == "eval":
            positions = step * self.config.loader.batch_size + self.row_indices
            owners, indices = self.mixer.eval_assign(positions, [d.eval_count() for d in self.datasets])
            return owners, self._examples_of(owners, indices)
        located = self._located_steps(step)
        if located is None:   # a dataset still being built: this step alone
            owners, indices = self.mixer.assign(step, self.row_indices)
        else:
            a = (step - located.first) * self.rows
            owners = located.owners[a : a + self.rows]
            if located.part is not None:
                return owners, located.part(a, a + self.rows)
            indices = located.indices[a : a + self.rows]
        sole = _sole_owner(owners)
        if sole is not None:
            return owners, self.datasets[sole].train_windows(indices)
        return owners, self._examples_of(owners, indices)

    @property
    def complete(self) -> bool:
        """Whether every dataset is built: no batch waits for a chunk of a build any more."""
        return all(d.chunks.complete for d in self.datasets)

    def _located_steps(self, step: int) -> LocatedSteps | None:
        """The training steps from ``step`` on whose rows are assigned together and, when one
        dataset owns them all, whose examples it locates together (``train_block``): the steps
        last located if they hold ``step``, else :data:`LOCATE_AHEAD` steps if ``step`` follows
        them (steps asked in order), else ``step`` alone (a seek: its first batch locates no more
        than its own). None while a dataset is being built (locating later steps then could wait
        for chunks this one does not need)."""
        located = self._located   # (read once: threads building batches may replace it)
        if located is not None and located.first <= step < located.first + located.steps:
            return located
        if not self.complete:
            return None
        total = self.num_batches()
        steps = LOCATE_AHEAD if located is not None and step == located.first + located.steps else 1
        if total is not None:
            steps = min(steps, total - step)
        assigned = [self.mixer.assign(s, self.row_indices) for s in range(step, step + steps)]
        owners = np.concatenate([owners for owners, _ in assigned])
        indices = np.concatenate([indices for _, indices in assigned])
        sole = _sole_owner(owners)
        located = LocatedSteps(step, steps, owners, indices,
                               None if sole is None else self.datasets[sole].train_block(indices, self.rows))
        self._located = located
        return located

    def _examples_of(self, owners: np.ndarray, indices: np.ndarray) -> list[Example | None]:
        """The example of each row: example ``indices[i]`` of dataset ``owners[i]`` (-1: None)."""
        windows: list[Example | None] = [None] * len(owners)   # None: past an eval pass
        for owner in np.unique(owners[owners >= 0]).tolist():
            rows = np.flatnonzero(owners == owner)
            examples = self.datasets[owner]
            if self.mode == "eval":
                found = examples.eval_windows(indices[rows])
            else:
                found = examples.train_windows(indices[rows])
            for row, window in zip(rows.tolist(), found):
                windows[row] = window
        return windows

    def check_step(self, step: int) -> None:
        """Raise :class:`StepRangeError` naming the valid steps unless batch ``step`` exists."""
        # A negative step in training needs no count (a stop strategy's waits for the whole lake).
        total = self.num_batches() if step >= 0 or self.mode == "eval" else None
        if step >= 0 and (total is None or step < total):
            return
        if total is None:
            valid = "steps 0 and up"
        else:
            valid = f"steps 0..{total - 1}" if total else "none (no batches)"
            valid += (f"; the eval pass has {total} batches" if self.mode == "eval" else
                      f"; training stops after {total} batches (mixture stop: {self.mixer.stop})")
        raise StepRangeError(f"step {step} does not exist: valid are {valid}")

    def batch(self, step: int, pool: ArraySource | None = None) -> Batch:
        """This process's rows of global batch ``step``: the row fields ``loader.fields`` names
        (arrays of shape [rows, seq_len]) and ``dataset_ids``, the caller's to keep and change:
        their memory is recycled for a later batch only once nothing refers to them any more
        (:class:`~lakeloader.feed.rows.ArrayPool`). ``pool``: where the row fields' memory comes
        from instead (a worker's shared-memory slot)."""
        self.check_step(step)
        owners, examples = self._windows(step)
        arrays = self._empty_batch(self._arrays if pool is None else pool, whole=self._whole_rows)
        fill_batch(arrays, examples)
        arrays["dataset_ids"] = owners.astype(np.int32)   # position in dataset_names(config); -1: padding
        if self.mode == "eval":
            arrays["example_mask"] = np.array([e is not None for e in examples], np.float32)
        return arrays

    def _empty_batch(self, pool: ArraySource, whole: bool = False) -> Batch:
        """The batch's arrays from ``pool``, padding in every row; ``whole``: every row field is
        about to be written in full (concat windows in training), so those are left unset."""
        loader = self.config.loader
        shape = (self.rows, loader.seq_len)
        padding = {"input_ids": self.pad_id, "targets": self.pad_id}   # (the other fields' padding is 0)
        arrays: Batch = dict(zip(loader.fields, pool.empty_fields(shape, [field_dtype(n) for n in loader.fields])))
        if not whole:
            for name, values in arrays.items():
                values.fill(padding.get(name, 0))
        if self._seq2seq:
            arrays["inputs"] = pool.full(shape, self.pad_id, np.int32)
            arrays["inputs_segment_ids"] = pool.full(shape, 0, np.int32)
            arrays["inputs_positions"] = pool.full(shape, 0, np.int32)
        if self._max_images:
            arrays["image_positions"] = np.full((self.rows, self._max_images), -1, np.int32)
            arrays["image_refs"] = np.full((self.rows, self._max_images), "", dtype=object)
        return arrays

    def state(self, step: int) -> dict[str, Any]:
        """JSON-serializable state to save so that :meth:`restore` (or :meth:`iter_from`)
        continues at ``step``: ``{"step": step, "fingerprint": ...}``, as ``JaxFeed.state``."""
        return LoaderState(step, self.fingerprint).to_dict()

    def restore(self, state: dict[str, Any] | LoaderState) -> Iterator[Batch]:
        """Batches from a saved state on (checks the fingerprint), as ``JaxFeed.restore``."""
        return self.iter_from(state)

    def _start(self, start: int | LoaderState | dict[str, Any]) -> int:
        if isinstance(start, dict):
            start = LoaderState.from_dict(start)
        if isinstance(start, LoaderState):
            if start.fingerprint != self.fingerprint:
                raise LakeloaderError(
                    f"loader state has fingerprint {start.fingerprint} but this config and lake give "
                    f"{self.fingerprint}: the data, mixture or loader settings changed since the state "
                    "was saved; restore with the same config and lake, or start a new run")
            return start.step
        return int(start)

    def iter_from(self, start: int | LoaderState | dict[str, Any] = 0) -> Iterator[Batch]:
        """Batches from ``start`` (a step or a saved state) on, read ahead in a background thread,
        or built by ``loader.workers`` worker processes (the same batches; each a fresh array
        the caller may keep). The workers stop when the iterator is closed or collected, or
        when :meth:`close` is called."""
        iterator = self._iterate(self._start(start))
        if self.mode == "train" and self.config.loader.shuffle.kind == "full":
            self._warn_if_beyond_the_cache()   # here, not in workers' own loaders: said once
        self._iterators.add(iterator)
        return iterator

    def _iterate(self, step: int) -> Iterator[Batch]:
        total = self.num_batches()
        ahead = self.config.loader.prefetch
        if self.config.loader.workers:
            # Each worker opens its own loader over the same config and rows; a build's live
            # catalog handle stays here: workers read the published snapshot, as other processes do
            # (waiting for the build's first one).
            make_loader = functools.partial(_worker_loader, self.config, process_index=self.process_index,
                                            process_count=self.process_count, mode=self.mode,
                                            rows=self.row_indices.tolist())
            # This process builds the first batches while the workers start, then drops the row
            # groups it decoded for them (the workers read on from their own caches).
            yield from worker_batches(make_loader, self.config.loader.workers, step, total, ahead,
                                      self.batch, self.files.cache.clear)
            return
        if ahead == 0:
            while total is None or step < total:
                yield self.batch(step)
                step += 1
            return
        # From a local lake one thread builds the batches ahead, in order: batches built side by
        # side only contend for the GIL and the caches (a batch's row groups are read concurrently
        # anyway, in the decode threads of read/windows.py). From an object store, ``prefetch``
        # threads, so that the next batches' downloads overlap (measured: docs/performance-history.md).
        builders = 1 if self.lake.is_local else ahead
        with ReadAhead(self.batch, step, total, ahead, builders, "lakeloader-prefetch") as batches:
            yield from batches

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from(0)

    # -- provenance ------------------------------------------------------------------------------

    def examples(self, step: int) -> StepExamples:
        """The examples feeding this process's rows of batch ``step`` (None for the padding rows
        past the end of an evaluation pass) with each row's global row number and each dataset's
        chunk-to-shard map: what :meth:`batch` writes, before it is written."""
        self.check_step(step)
        owners, windows = self._windows(step)
        return StepExamples(step, self.row_indices.copy(), list(windows),
                            {d.name: d.chunks.shard_index for d in self.datasets}, owners.astype(np.int32))

    def explain(self, step: int) -> pd.DataFrame:
        """For every row of batch ``step`` on this process: which dataset, epoch, chunk, shard,
        source document (file and line/row) and token range fed each of its segments."""
        return explain(self.examples(step), self.view)

    def close(self) -> None:
        """Stop open iterators' read-ahead and the readers' decoding ahead, and release the
        catalog connection."""
        for iterator in list(self._iterators):
            iterator.close()
        for dataset in self.datasets:
            dataset.reader.close()
        self.view.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _worker_loader(config: Config, **options: Any) -> Loader:
    """A worker's loader (``loader.workers``) over ``config``. Workers read the published
    snapshot: while the build their consumer follows has published none yet, this waits for its
    first one (``loader.wait_timeout`` at most, as a reader waits for a chunk)."""
    deadline = time.monotonic() + config.loader.wait_timeout
    while True:
        try:
            return Loader(config, **options)
        except CatalogNotPublishedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(POLL_SECONDS)   # (as a reader polls for a chunk)
