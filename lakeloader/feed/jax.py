"""Global ``jax.Array`` batches laid out by the user's sharding; each process reads only its rows."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lakeloader.config import Config, load_config
from lakeloader.feed.loader import Batch, Loader
from lakeloader.feed.pixels import PIXEL_FIELDS
from lakeloader.feed.run_state import LoaderState
from lakeloader.specs import evaluation_config

_DONE = object()
# Per-row fields whose second axis is not the sequence, whatever its length (a row's patches may
# number seq_len): split along the batch axis only.
ROW_FIELDS = frozenset({*PIXEL_FIELDS, "image_positions"})


def rows_of_this_process(sharding: NamedSharding, batch_size: int, seq_len: int) -> np.ndarray:
    """Global batch rows held by this process's addressable devices under ``sharding``."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map((batch_size, seq_len)).values():
        rows.update(range(*index[0].indices(batch_size)))
    return np.array(sorted(rows), dtype=np.int64)


class JaxFeed:
    """Batches of a lake as global ``jax.Array`` dicts with a ``NamedSharding`` over a ``Mesh``.

    The batch axis is the first axis of ``spec`` (replication over other mesh axes is allowed).
    Each process materializes only the rows its addressable devices hold and the arrays are
    assembled with ``jax.make_array_from_callback``; batches are identical for any number of
    processes. ``state``/``restore`` give a JSON-serializable loader state for checkpoints.
    """

    def __init__(self, config: Config | str | os.PathLike[str], mesh: Mesh, spec: PartitionSpec | None = None,
                 *, mode: str = "train", prefetch: int = 2) -> None:
        loaded = load_config(config)
        self.config = evaluation_config(loaded) if mode == "eval" else loaded   # (what the loader reads)
        self.mesh = mesh
        self.spec = spec if spec is not None else PartitionSpec(mesh.axis_names[0])
        self.sharding = NamedSharding(mesh, self.spec)
        self.row_sharding = NamedSharding(mesh, PartitionSpec(self.spec[0] if len(self.spec) else None))
        self.batch_size, self.seq_len = self.config.loader.batch_size, self.config.loader.seq_len
        self.rows = rows_of_this_process(self.sharding, self.batch_size, self.seq_len)
        self.loader = Loader(loaded, process_index=jax.process_index(),
                             process_count=jax.process_count(), mode=mode, rows=self.rows)
        self.prefetch = prefetch
        self._row_slices: dict[tuple[int, int, int], slice | np.ndarray] = {}
        self._producers: list[tuple[threading.Thread, threading.Event]] = []

    @property
    def fingerprint(self) -> str:
        """Fingerprint of what defines the batches (same on every process and process count)."""
        return self.loader.fingerprint

    def to_global(self, local: Batch) -> dict[str, jax.Array]:
        """Global arrays from this process's rows (in ``self.rows`` order): ``[rows, seq_len]``
        fields laid out by ``spec``, the others (pixels and image fields, :data:`ROW_FIELDS`,
        whatever their shape) along its batch axis only. Fields that are not numbers
        (``image_refs``) stay host numpy arrays of this process's rows."""
        arrays: dict[str, Any] = {name: values for name, values in local.items() if values.dtype == object}
        numeric = {name: values for name, values in local.items() if values.dtype != object}
        shardings = {name: self.sharding if name not in ROW_FIELDS and values.ndim == 2
                     and values.shape[1] == self.seq_len else self.row_sharding for name, values in numeric.items()}
        if len(self.rows) == self.batch_size:   # every row is here: one transfer of all fields
            arrays.update(jax.device_put(numeric, shardings))
            return arrays
        for name, values in numeric.items():

            def piece(index: tuple[slice, ...], values: np.ndarray = values) -> np.ndarray:
                return values[(self._local_rows(index[0]), *index[1:])]

            arrays[name] = jax.make_array_from_callback((self.batch_size, *values.shape[1:]), shardings[name], piece)
        return arrays

    def _local_rows(self, index: slice) -> slice | np.ndarray:
        """Where the global rows ``index`` lie among this process's rows: a slice (views, no copy)
        when they are consecutive there, as they are under a batch-axis sharding."""
        key = index.indices(self.batch_size)
        if key not in self._row_slices:
            local = np.searchsorted(self.rows, np.arange(*key))
            consecutive = len(local) > 0 and bool((np.diff(local) == 1).all())
            self._row_slices[key] = slice(int(local[0]), int(local[-1]) + 1) if consecutive else local
        return self._row_slices[key]

    def batch(self, step: int) -> dict[str, jax.Array]:
        """Global batch ``step`` as sharded arrays."""
        return self.to_global(self.loader.batch(step))

    def state(self, step: int) -> dict[str, Any]:
        """JSON-serializable state that restores to ``step`` (e.g. ``orbax.checkpoint.args.JsonSave``)."""
        return self.loader.state(step)

    def restore(self, state: dict[str, Any], *, continue_changes: bool = False) -> Iterator[dict[str, jax.Array]]:
        """Batches from a saved state on, on any number of processes (``continue_changes``: go on
        under an edited config, :meth:`Loader.follow`)."""
        return self.iter_from(LoaderState.from_dict(state), continue_changes=continue_changes)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the lake's tokenizer, special tokens included."""
        return self.loader.vocab_size

    def iter_from(self, start: int | LoaderState | dict[str, Any] = 0, *,
                  continue_changes: bool = False) -> Iterator[dict[str, jax.Array]]:
        """Device batches from ``start`` on, ``prefetch`` of them transferred ahead in a thread.
        A saved state from another config fails here, not at the first batch."""
        return self._device_batches(self.loader.iter_from(start, continue_changes=continue_changes))

    def _device_batches(self, host: Iterator[Batch]) -> Iterator[dict[str, jax.Array]]:
        if self.prefetch == 0:
            for local in host:
                yield self.to_global(local)
            return
        ready: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def produce() -> None:
            try:
                for local in host:
                    item = self.to_global(local)
                    while not stop.is_set():
                        try:
                            ready.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                ready.put(_DONE)
            except BaseException as exc:  # handed to the consumer, which raises it
                ready.put(exc)
            finally:
                host.close()

        thread = threading.Thread(target=produce, name="lakeloader-device-prefetch", daemon=True)
        self._producers = [(t, e) for t, e in self._producers if t.is_alive()] + [(thread, stop)]
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return self.iter_from(0)

    def close(self) -> None:
        """Stop background transfers and release the loader's catalog connection."""
        for _, stop in self._producers:
            stop.set()
        for thread, _ in self._producers:
            thread.join(timeout=60)
        self.loader.close()

    def __enter__(self) -> JaxFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
