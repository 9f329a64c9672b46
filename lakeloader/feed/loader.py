"""The loader: global batch ``b`` = examples ``[b*B, (b+1)*B)``; each process builds only its rows.

Loader state is ``{step, fingerprint}``: seeking to any step is index arithmetic and catalog
lookups, never a replay of data.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd
from tokenizers import Tokenizer

from lakeloader.config import Config, ShuffleConfig, load_config
from lakeloader.errors import ConfigError, LakeloaderError
from lakeloader.feed.examples import DatasetExamples, Window
from lakeloader.index.mixing import Mixer
from lakeloader.index.concat import segments
from lakeloader.lake import Lake
from lakeloader.read.catalog_view import CatalogView
from lakeloader.read.chunks import ChunkFiles
from lakeloader.read.windows import Specials, StreamReader
from lakeloader.tokenizer import cached_tokenizer

log = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]


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


def _token_id(tokenizer: Any, key: str, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ConfigError(
            f"loader.{key} = {token!r} is not a token of the lake's tokenizer; set loader.{key} to one "
            "of its special tokens"
        )
    return int(found)


class Loader:
    """Deterministic global batches of a lake for process ``process_index`` of ``process_count``.

    ``mode="train"`` cycles the data forever (epochs reshuffle nothing yet: order is fixed);
    ``mode="eval"`` is one finite pass in order with the last batch padded and masked.
    """

    def __init__(self, config: Config | str | os.PathLike[str], *, process_index: int = 0,
                 process_count: int = 1, mode: str = "train", rows: Sequence[int] | None = None) -> None:
        """``rows`` (global row numbers within each batch) overrides the contiguous block of
        process ``process_index`` of ``process_count``, for shardings that own other rows."""
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
        if loader.packing != "concat":
            raise ConfigError(f"loader.packing = {loader.packing!r} is not supported yet; use 'concat'")
        self.mode = mode
        self.process_index, self.process_count = process_index, process_count
        self.lake = Lake(config.lake, config.storage_options)
        self.view = CatalogView(self.lake, config.io_retry_deadline)
        self.files = ChunkFiles(self.lake, loader.verify, loader.cache_bytes, loader.disk_cache_bytes,
                                config.io_retry_deadline)
        self.mixer = Mixer.from_config(config)
        self.specials = self._specials()
        reader = StreamReader(self.view, self.files, self.specials)
        ordering = loader.ordering if mode == "train" else "global"
        shuffle = loader.shuffle if mode == "train" else ShuffleConfig()
        if ordering == "strided" and shuffle.kind != "none":
            raise ConfigError(
                f"loader.shuffle.kind = {shuffle.kind!r} needs loader.ordering: global (the strided "
                "ordering fixes its own order); set shuffle to none or ordering to global")
        self.datasets = [
            DatasetExamples(name, self.view, reader, seq_len=loader.seq_len, ordering=ordering,
                            ideal_readers=loader.ideal_readers, wait_timeout=loader.wait_timeout,
                            shuffle=shuffle, seed=loader.seed)
            for name in self.mixer.names
        ]
        self.fingerprint = self._fingerprint()
        self._iterators: weakref.WeakSet[Iterator[Batch]] = weakref.WeakSet()

    def _specials(self) -> Specials:
        path = self.view.named("tokenizer_path", {"datasets": list(self.mixer.names)}).fetchone()
        if path is None:
            raise LakeloaderError(f"the lake {self.lake.url} has none of the datasets {self.mixer.names}")
        if self.lake.is_local:
            tokenizer = cached_tokenizer(self.lake.path_of(path[0]))
        else:
            tokenizer = Tokenizer.from_str(self.lake.fs.cat_file(self.lake.path_of(path[0])).decode())
        self.tokenizer = tokenizer
        loader = self.config.loader
        eos = _token_id(tokenizer, "eos_token", loader.eos_token)
        bos = _token_id(tokenizer, "bos_token", loader.bos_token) if loader.bos_token else None
        pad = _token_id(tokenizer, "pad_token", loader.pad_token) if loader.pad_token else eos
        return Specials(eos=eos, bos=bos, pad=pad)

    def _fingerprint(self) -> str:
        loader = self.config.loader
        payload = {
            "datasets": {d.name: d.fingerprint for d in self.datasets},
            "mixture": self.config.mixture.model_dump() if self.config.mixture else None,
            "loader": loader.model_dump(
                exclude={"wait_timeout", "prefetch", "verify", "cache_bytes", "disk_cache_bytes"}),
            "specials": dataclasses.asdict(self.specials),
            "mode": self.mode,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]

    # -- sizes -----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the lake's tokenizer, special tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def num_batches(self) -> int | None:
        """Batches of an evaluation pass, or of training under a stop strategy (the same on every
        process; waits for the complete lake); None when training cycles forever."""
        if self.mode == "train":
            return self.mixer.stop_step(self.datasets)
        return -(-self.mixer.eval_total(self.datasets) // self.config.loader.batch_size)

    # -- batches ---------------------------------------------------------------------------------

    def _windows(self, step: int) -> list[Window | None]:
        positions = step * self.config.loader.batch_size + self.row_indices
        if self.mode == "eval":
            owners, indices = self.mixer.eval_assign(positions, self.datasets)
        else:
            owners, indices = self.mixer.assign(step, self.row_indices)
        windows: list[Window | None] = []
        for owner, index in zip(owners.tolist(), indices.tolist()):
            if owner < 0:
                windows.append(None)  # padding past the end of an evaluation pass
                continue
            examples = self.datasets[owner]
            windows.append(examples.eval_window(index) if self.mode == "eval" else examples.train_window(index))
        return windows

    def batch(self, step: int) -> Batch:
        """This process's rows of global batch ``step``: arrays of shape [rows, seq_len]."""
        if step < 0:
            raise LakeloaderError(f"step must be >= 0, got {step}")
        total = self.num_batches
        if total is not None and step >= total:
            raise IndexError(f"step {step} is past the last batch ({total} batches)")
        length = self.config.loader.seq_len
        shape = (self.rows, length)
        input_ids = np.full(shape, self.specials.pad, np.int32)
        targets = np.full(shape, self.specials.pad, np.int32)
        loss_mask = np.zeros(shape, np.float32)
        segment_ids = np.zeros(shape, np.int32)
        positions = np.zeros(shape, np.int32)
        example_mask = np.zeros(self.rows, np.float32)
        for row, window in enumerate(self._windows(step)):
            if window is None:
                continue
            tokens, keys = window.tokens, window.doc_keys
            n = len(tokens) - 1
            input_ids[row, :n] = tokens[:-1]
            targets[row, :n] = tokens[1:]
            loss_mask[row, :n] = 1.0
            segment_ids[row, :n], positions[row, :n] = segments(keys[:-1])
            example_mask[row] = 1.0
        batch = {"input_ids": input_ids, "targets": targets, "loss_mask": loss_mask,
                 "segment_ids": segment_ids, "positions": positions}
        if self.mode == "eval":
            batch["example_mask"] = example_mask
        return batch

    def state(self, step: int) -> LoaderState:
        """The state to save so that a restore continues at ``step``."""
        return LoaderState(step, self.fingerprint)

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
        """Batches from ``start`` (a step or a saved state) on, read ahead in background threads."""
        iterator = self._iterate(self._start(start))
        self._iterators.add(iterator)
        return iterator

    def _iterate(self, step: int) -> Iterator[Batch]:
        total = self.num_batches
        ahead = self.config.loader.prefetch
        if ahead == 0:
            while total is None or step < total:
                yield self.batch(step)
                step += 1
            return
        with concurrent.futures.ThreadPoolExecutor(ahead, thread_name_prefix="lakeloader-prefetch") as pool:
            pending: dict[int, concurrent.futures.Future[Batch]] = {}
            try:
                while total is None or step < total:
                    for ahead_step in range(step, step + ahead + 1):
                        if ahead_step not in pending and (total is None or ahead_step < total):
                            pending[ahead_step] = pool.submit(self.batch, ahead_step)
                    yield pending.pop(step).result()
                    step += 1
            finally:
                for future in pending.values():
                    future.cancel()

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from(0)

    # -- provenance ------------------------------------------------------------------------------

    def explain(self, step: int) -> pd.DataFrame:
        """For every row of batch ``step`` on this process: which dataset, epoch, chunk, shard,
        source document (file and line/row) and token range fed each of its segments."""
        from lakeloader.feed.explain import explain_windows

        return explain_windows(self, step, self._windows(step))

    def close(self) -> None:
        """Stop open iterators' read-ahead and release the catalog connection."""
        for iterator in list(self._iterators):
            iterator.close()
        self.view.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
