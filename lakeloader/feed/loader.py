"""The loader: global batch ``b`` = examples ``[b*B, (b+1)*B)``; each process builds only its rows.

It assembles each dataset's example stream (:mod:`lakeloader.feed.stream`) from settings checked
before any I/O (:mod:`lakeloader.feed.settings`), maps each step's rows to datasets through the
run's mixer, and hands batches out from a read-ahead thread or worker processes. A saved state
(:mod:`lakeloader.feed.run_state`) resumes at any step by index arithmetic and catalog lookups,
never a replay of data.
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
from lakeloader.config import Config, load_config
from lakeloader.contracts.errors import CatalogNotPublishedError, ConfigError, LakeloaderError, StepRangeError
from lakeloader.feed.explain import explain
from lakeloader.feed.packed import PackedExample
from lakeloader.feed.pixels import PixelFill, PlacedImage
from lakeloader.feed.prompts import prompt_batch
from lakeloader.feed.read_ahead import ReadAhead
from lakeloader.feed.rows import ArrayPool, ArraySource, Batch, Example, StepExamples, field_dtype, fill_batch
from lakeloader.feed.run_state import LoaderState, definition_changes, grown_plans
from lakeloader.feed.settings import loader_settings
from lakeloader.feed.stream import ExampleStream, dataset_stream
from lakeloader.feed.workers import worker_batches
from lakeloader.index.growth import EpochSizes
from lakeloader.index.mixture import Mixer, stage_totals
from lakeloader.index.revisions import RunMixture, continued
from lakeloader.read.catalog_view import POLL_SECONDS, CatalogView
from lakeloader.images import DECODER
from lakeloader.read.chunks import ChunkFiles
from lakeloader.read.media import MediaFiles
from lakeloader.specs import (
    evaluation_config,
    image_resolution,
    mixture_spec,
    packing_spec,
    stores_images,
    template_for,
    token_id,
    token_weights,
)

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


class Loader:
    """Deterministic global batches of a lake for process ``process_index`` of ``process_count``.

    ``mode="train"`` cycles the data forever, each epoch in its own order under a shuffle (the
    epoch is part of every permutation's key); ``mode="eval"`` is one finite pass in order with
    the last batch padded and masked. ``dataset_names`` are the datasets a batch's
    ``dataset_ids`` number, in that order.

    A training run can be continued under an edited config (its mixture reweighted or restaged,
    datasets added or left out): :meth:`iter_from` a saved state with ``continue_changes=True``
    starts a new revision of the run at the state's step, and the loader then follows the run's
    mixture (:class:`~lakeloader.index.revisions.RunMixture`): every earlier step keeps its batch
    and each dataset continues its own order where it stopped.
    """

    def __init__(self, config: Config | str | os.PathLike[str], *, process_index: int = 0,
                 process_count: int = 1, mode: str = "train", rows: Sequence[int] | None = None,
                 catalog: LiveCatalog | None = None) -> None:
        """``rows`` (global row numbers within each batch) overrides the contiguous block of
        process ``process_index`` of ``process_count``, for shardings that own other rows.
        ``catalog``: the live-catalog handle of a build running in this process (the one given
        to ``build(config, live=...)``) to read its live catalog while it runs; without it the
        loader reads the published snapshot, as in any other process."""
        config = load_config(config)
        self.config = config = evaluation_config(config) if mode == "eval" else config
        loader = config.loader
        self.settings = settings = loader_settings(config, mode=mode, process_index=process_index,
                                                   process_count=process_count, rows=rows)
        self.mode, self.row_indices, self.rows = mode, settings.row_indices, len(settings.row_indices)
        self.process_index, self.process_count = process_index, process_count
        self.lake = Lake(config.lake, config.storage_options)
        self.view = CatalogView(self.lake, config.io_retry_deadline, live=catalog)
        self.files = ChunkFiles(self.lake, loader.verify, loader.cache_bytes, loader.disk_cache_bytes,
                                config.io_retry_deadline, view=self.view)
        self.media = MediaFiles(self.lake, config.io_retry_deadline, self.view)
        self.dataset_names = names = settings.names
        self.view.check_own_plans(config, names)   # the lake's plan of each name is this config's definition
        self.tokenizer = self.lake.tokenizer_at(self.view.tokenizer_path(names), names)
        self.pad_id = token_id(self.tokenizer, "loader.pad_token", loader.pad_token or loader.eos_token)
        self.templates = {name: template_for(name, config, self.tokenizer) for name in names}
        self.datasets: list[ExampleStream] = [self._stream(name) for name in names]
        means = None
        if token_weights(config):
            for stream in self.datasets:   # (waits for each dataset: the weights need its mean example size)
                stream.train_count()
            with self.view.reading() as cursor:
                means = example_token_means(cursor, {d.name: d.plan_key for d in self.datasets}, loader.seq_len)
        self.own_mixture = mixture_spec(config, means)   # this config's, from step 0
        self.definition = self._definition()
        self.fingerprint = hashlib.sha256(json.dumps(self.definition, sort_keys=True).encode()).hexdigest()[:32]
        self._iterators: weakref.WeakSet[Iterator[Batch]] = weakref.WeakSet()
        self._arrays = ArrayPool()
        self._follow(RunMixture(self.own_mixture))

    def _follow(self, run: RunMixture) -> None:
        """Make batches as ``run`` mixes them (this config's mixture, or a saved run's): a stream
        for each of its datasets, its mixer, and what follows from them."""
        have = {stream.name: stream for stream in self.datasets}
        missing = [name for name in run.spec.names if name not in have and name not in self.config.datasets]
        if missing:
            raise ConfigError(
                f"the run draws from dataset(s) {missing} in earlier steps, which {self.config.source_file or 'this config'} "
                "no longer defines: keep their sections under datasets: (left out of the mixture, or with weight 0) so "
                "that those steps can still be read")
        new = [name for name in run.spec.names if name not in have]
        self.view.check_own_plans(self.config, new)
        added = []
        for name in new:
            self.templates[name] = template_for(name, self.config, self.tokenizer)
            added.append(self._stream(name))
        have.update((stream.name, stream) for stream in added)
        self.datasets = [have[name] for name in run.spec.names]
        self.dataset_names = run.spec.names
        for stream in self.datasets:
            stream.follow_sizes(run.sizes(stream.name))
        self.run = run
        self.mixer = Mixer.of(run.spec)
        self._num_batches: tuple[int | None] | None = None   # once computed (None is a count too)
        self._located: LocatedSteps | None = None   # the training steps last located together
        # Training rows are written whole (concat spans; packed examples with their padding).
        self._whole_rows = self.mode == "train" and all(d.fills_whole_rows for d in self.datasets)
        # The fields beyond the row fields that every batch has (the mixture's datasets say which).
        mixed = [self.config.datasets[name] for name in self.mixer.names]
        self._seq2seq = any(d.seq2seq for d in mixed)
        self._max_images = max((d.interleaved.max_images for d in mixed if d.format == "interleaved"), default=0)
        stored = [d for d in mixed if stores_images(d)]   # (check_combination: one resolution for them all)
        self._pixels = None if not stored else PixelFill(
            self.media, image_resolution(stored[0]), self._max_images, self.config.loader.seq_len,
            self.config.loader.image_cache_bytes, stored[0].interleaved.max_pixels)

    def _warn_if_beyond_the_cache(self) -> None:
        """Warn when a full shuffle reads datasets much larger than the row-group cache: nearly
        every example then reads a row group no longer cached (from the pages its example needs)."""
        stored = sum(d.chunks.stored_bytes for d in self.datasets)
        cache = self.config.loader.cache_bytes
        if stored > 2 * cache:
            log.warning(
                "loader.shuffle.kind: full over %.1f GB of stored tokens with loader.cache_bytes %.2f GB: most "
                "examples land in a row group no longer cached (build.row_group_tokens: %d tokens) and read it "
                "again, from the pages each example needs, a few M tokens/s. For a lake much larger than the "
                "cache use loader.shuffle.kind block or window, or raise loader.cache_bytes towards the lake's size",
                stored / 1e9, cache / 1e9, self.config.build.row_group_tokens)

    def _stream(self, name: str) -> ExampleStream:
        """Dataset ``name``'s example stream under this loader's settings."""
        loader, settings = self.config.loader, self.settings
        template = self.templates[name]
        return dataset_stream(name, self.view, self.files, template, packing_spec(name, self.config, template),
                              seq_len=loader.seq_len, ordering=settings.ordering, ideal_readers=loader.ideal_readers,
                              shuffle=settings.shuffle, seed=loader.seed, wait_timeout=loader.wait_timeout,
                              seq2seq=self.config.datasets[name].seq2seq, pad_id=self.pad_id)

    def _definition(self) -> dict[str, Any]:
        """What defines this config's batches, as JSON: its datasets' plans and collation, its
        mixture, the loader settings that shape examples and batches, the padding id and the
        mode. The fingerprint hashes it; a saved state keeps it to say what changed."""
        loader = self.config.loader.model_dump(
            exclude={"wait_timeout", "prefetch", "workers", "verify", "cache_bytes", "disk_cache_bytes", "fields",
                     "image_cache_bytes"})
        # (loader.pack.open_examples under its name from before it was renamed, so that the
        # fingerprints of states saved then still match)
        loader["pack"]["window"] = loader["pack"].pop("open_examples")
        definition = {
            "datasets": {d.name: d.fingerprint for d in self.datasets},
            "mixture": self.config.mixture.model_dump() if self.config.mixture else None,
            "loader": loader,
            "templates": {name: t.fingerprint for name, t in self.templates.items()},
            "pad": self.pad_id,
            "mode": self.mode,
        }
        # Stored images' pixels depend on the decoder and the resolution too (only then: the
        # fingerprints of other configs stay as they were): a decoder upgrade is never silent.
        stored = {d.name: image_resolution(self.config.datasets[d.name]).payload for d in self.datasets
                  if stores_images(self.config.datasets[d.name])}
        if stored:
            definition["images"] = {"decoder": DECODER, "resolution": stored}
        return definition

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

    def _row_examples(self, step: int) -> tuple[np.ndarray, Sequence[Example | None]]:
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
            return owners, self.datasets[sole].train(indices)
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
        examples: list[Example | None] = [None] * len(owners)   # None: past an eval pass
        for owner in np.unique(owners[owners >= 0]).tolist():
            rows = np.flatnonzero(owners == owner)
            stream = self.datasets[owner]
            found = stream.eval(indices[rows]) if self.mode == "eval" else stream.train(indices[rows])
            for row, example in zip(rows.tolist(), found):
                examples[row] = example
        return examples

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
        owners, examples = self._row_examples(step)
        source = self._arrays if pool is None else pool
        arrays = self._empty_batch(source, whole=self._whole_rows)
        fill_batch(arrays, examples)
        if self._pixels is not None:
            self._pixels.fill(arrays, self._placed_images(owners, examples))
        # (every numeric field from ``source``: in a worker's slot each then stays where it was)
        arrays["dataset_ids"] = source.empty((len(owners),), np.int32)
        arrays["dataset_ids"][:] = owners   # position in dataset_names(config); -1: padding
        if self.mode == "eval":
            arrays["example_mask"] = np.array([e is not None for e in examples], np.float32)
            if self.config.evaluation is not None and self.config.evaluation.prompts:
                return prompt_batch(arrays, self.pad_id)
        return arrays

    def _placed_images(self, owners: np.ndarray, examples: Sequence[Example | None]) -> list[PlacedImage]:
        """The stored images the rows place, each row's in the order of its ``image_positions``."""
        placed = []
        for owner in np.unique(owners[owners >= 0]).tolist():
            stream = self.datasets[owner]
            if not stores_images(self.config.datasets[stream.name]):
                continue
            for row in np.flatnonzero(owners == owner).tolist():
                example = examples[row]
                assert isinstance(example, PackedExample)   # (interleaved: packed, item by item)
                number = 0
                for item in example.items:
                    for _, image in item.images:
                        placed.append(PlacedImage(row, number, stream.chunks.record(item.chunk).path, image))
                        number += 1
        return placed

    def _empty_batch(self, pool: ArraySource, whole: bool = False) -> Batch:
        """The batch's arrays from ``pool``, padding in every row; ``whole``: every row field is
        about to be written in full (concat spans in training), so those are left unset."""
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
            arrays["image_positions"] = pool.full((self.rows, self._max_images), -1, np.int32)
            arrays["image_refs"] = np.full((self.rows, self._max_images), "", dtype=object)
        if self._pixels is not None:
            arrays.update(self._pixels.empty(pool, self.rows))
        return arrays

    def state(self, step: int) -> dict[str, Any]:
        """JSON-serializable state to save so that :meth:`restore` (or :meth:`iter_from`)
        continues at ``step``, as ``JaxFeed.state``: the step, the fingerprint and definition of
        this config's batches, and the mixture the run has followed (its revisions included); a
        few KB, whatever the step."""
        # (the plans of the datasets the run reads beyond this config's: the definition has the others)
        plans = {d.name: d.fingerprint for d in self.datasets if d.name not in self.definition["datasets"]}
        return LoaderState(step, self.fingerprint, self.definition, self.run, plans or None).to_dict()

    def restore(self, state: dict[str, Any] | LoaderState, *, continue_changes: bool = False) -> Iterator[Batch]:
        """Batches from a saved state on (see :meth:`iter_from`), as ``JaxFeed.restore``."""
        return self.iter_from(state, continue_changes=continue_changes)

    def follow(self, state: dict[str, Any] | LoaderState, *, continue_changes: bool = False) -> int:
        """Take up the run of a saved state and return its step: from then on this loader's
        batches at every step, before and after it, are the run's. A state of this config's
        definition is taken as it is. A state of another definition is refused, saying what
        changed, unless ``continue_changes`` and every change can be continued exactly (the
        mixture, datasets added or left out, files added to a dataset): the run then goes on under
        this config from the state's step (a new revision), each dataset continuing its own order
        where it stopped (a grown one: :meth:`_with_growth`)."""
        if isinstance(state, dict):
            state = LoaderState.from_dict(state)
        grown = grown_plans(state, self.definition, self.view)
        if state.fingerprint == self.fingerprint and not grown:
            if state.run is not None:
                self._follow(state.run)
            return state.step
        where = self.config.source_file or "this config"
        if state.definition is None or state.run is None:
            raise LakeloaderError(
                f"loader state has fingerprint {state.fingerprint} but {where} and its lake give {self.fingerprint}: "
                "the data, mixture or loader settings changed since the state was saved (a state saved before runs "
                "could be continued does not say what); restore with the same config and lake, or start a new run")
        continuable, fixed = definition_changes(state.definition, self.definition,
                                                {name: words for name, (_, words) in grown.items()})
        if fixed:
            raise LakeloaderError(
                f"the run saved at step {state.step} cannot be continued under {where}: " + "; ".join(fixed)
                + " (these decide a dataset's examples or a batch's shape); restore with the config the state was "
                "saved with (its definition is in the state), or start a new run")
        if self.mode != "train":
            raise LakeloaderError(
                f"an evaluation loader's state is restored only under the config it was saved with, and {where} "
                f"changed: {'; '.join(continuable)}")
        if not continue_changes:
            raise LakeloaderError(
                f"{where} changed since the state of step {state.step} was saved: {'; '.join(continuable)}. To go on "
                "under it from that step (earlier steps keep their batches; each dataset continues where it stopped), "
                "pass continue_changes=True (lakeloader batches --continue-changes); or restore with the config the "
                "state was saved with")
        growing = ", ".join(sorted({*grown, *(name for name, _ in state.run.growth)}))
        if growing and self.own_mixture.stop != "restart":
            raise LakeloaderError(
                f"the run saved at step {state.step} cannot be continued under {where}: dataset(s) {growing} grew, "
                "and a run over a grown dataset needs mixture.stop: restart (its epochs change size); set it, or put "
                "the new files in a dataset of their own")
        if grown and self.settings.ordering == "strided":
            raise LakeloaderError(
                f"the run saved at step {state.step} cannot be continued under {where}: dataset(s) {growing} grew, "
                "and under loader.ordering: strided each ideal reader loops over its own chunks, so no epoch can go "
                "on over the chunks it had planned; put the new files in a dataset of their own")
        try:
            run = continued(state.run, state.step, self.own_mixture)
        except ValueError as error:
            raise LakeloaderError(f"the run saved at step {state.step} cannot be continued under {where}: {error}") from None
        if grown:
            self._follow(run)   # (a stream for every dataset of the run first)
            run = self._with_growth(run, state.step, {name: chunks for name, (chunks, _) in grown.items()})
        log.info("continuing the run at step %d under %s: %s", state.step, where, "; ".join(continuable))
        self._follow(run)
        return state.step

    def _with_growth(self, run: RunMixture, step: int, grown: dict[str, int]) -> RunMixture:
        """``run`` taking up at ``step`` the grown plan of each dataset in ``grown`` (its older
        plan's chunks): the epoch the dataset is in goes on over the examples it had planned, then
        serves the new ones; later epochs are over all (:mod:`lakeloader.index.growth`). A
        dataset the run has not drawn from yet simply starts on its grown plan."""
        totals = stage_totals(list(run.spec.stages), run.spec.batch_size, np.array([step], np.int64))[0]
        growth = dict(run.growth)
        for name, chunks in grown.items():
            if name not in run.spec.names:
                continue
            stream = self.datasets[run.spec.names.index(name)]
            position = int(totals[run.spec.names.index(name)])
            sizes = growth.get(name)
            if sizes is None:
                if position == 0:
                    continue
                sizes = EpochSizes(((0, chunks, stream.available_within(chunks)),))
            examples = stream.train_count()
            growth[name] = sizes.grown(position, stream.chunks.planned, examples)
        return dataclasses.replace(run, growth=tuple(sorted(growth.items())))

    def _start(self, start: int | LoaderState | dict[str, Any], continue_changes: bool = False) -> int:
        if isinstance(start, (dict, LoaderState)):
            return self.follow(start, continue_changes=continue_changes)
        return int(start)

    def iter_from(self, start: int | LoaderState | dict[str, Any] = 0, *,
                  continue_changes: bool = False) -> Iterator[Batch]:
        """Batches from ``start`` (a step or a saved state: :meth:`follow`) on, read ahead in a
        background thread, or built by ``loader.workers`` worker processes (the same batches;
        each a fresh array the caller may keep). The workers stop when the iterator is closed or
        collected, or when :meth:`close` is called."""
        iterator = self._iterate(self._start(start, continue_changes))
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
            make_loader = functools.partial(_worker_loader, self.config, self.state(step),
                                            process_index=self.process_index, process_count=self.process_count,
                                            mode=self.mode, rows=self.row_indices.tolist())
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
        # anyway, in the decode threads of read/stream_reader.py). From an object store, ``prefetch``
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
        owners, examples = self._row_examples(step)
        return StepExamples(step, self.row_indices.copy(), list(examples),
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
        for stream in self.datasets:
            stream.close()
        self.view.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _worker_loader(config: Config, state: dict[str, Any], **options: Any) -> Loader:
    """A worker's loader (``loader.workers``) over ``config``, following the run of its
    consumer's ``state``. Workers read the published snapshot: while the build their consumer
    follows has published none yet, this waits for its first one (``loader.wait_timeout`` at
    most, as a reader waits for a chunk)."""
    deadline = time.monotonic() + config.loader.wait_timeout
    while True:
        try:
            loader = Loader(config, **options)
            loader.follow(state)
            return loader
        except CatalogNotPublishedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(POLL_SECONDS)   # (as a reader polls for a chunk)
