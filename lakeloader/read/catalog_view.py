"""What a reader knows of the catalog: each dataset's committed chunks as numpy arrays.

Readers given a build's live-catalog handle (in the build driver's process) share its catalog
connection while it runs; all others read the published snapshot and refresh it when they need
chunks they have not seen committed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import duckdb
import numpy as np

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.snapshot import open_snapshot, read_pointer
from lakeloader.catalog.store import LiveCatalog
from lakeloader.catalog.sql import query
from lakeloader.contracts.errors import CatalogError, LakeloaderError
from lakeloader.storage import with_retries

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25
T = TypeVar("T")


class ChunkWaitTimeout(LakeloaderError):
    """A reader waited longer than ``loader.wait_timeout`` for a chunk to be committed."""


@dataclasses.dataclass(frozen=True)
class DatasetChunks:
    """The committed prefix of one dataset's chunks, in global order."""

    name: str
    fingerprint: str
    complete: bool                 # every planned chunk is committed
    planned: int                   # chunks in the plan
    paths: np.ndarray              # object array of lake-relative paths
    num_docs: np.ndarray           # int64 per chunk
    num_tokens: np.ndarray         # int64 per chunk
    num_bytes: np.ndarray          # int64 per chunk
    checksums: np.ndarray          # object array
    shard_index: np.ndarray        # int64 per chunk
    token_type: str
    num_parts: np.ndarray          # int64 [chunks, kinds]: parts of each kind
    num_examples: np.ndarray | None = None   # int64 per chunk under a packing plan (pack | pad)
    filtered: bool = False         # defined by a filter: chunk files hold more than its documents

    @property
    def committed(self) -> int:
        """Number of chunks in the committed prefix."""
        return len(self.paths)

    def describe_prefix(self) -> str:
        """The committed prefix in words, for wait messages (a dataset may have none yet)."""
        if not self.committed:
            return f"none of its {self.planned} planned chunks is committed yet"
        return f"only chunks 0..{self.committed - 1} of {self.planned} are committed"


def part_matrix(column: Any, kinds: int) -> np.ndarray:
    """A LIST column of per-kind counts (the few row groups of a chunk) as an int64
    ``[rows, kinds]`` matrix; missing or empty lists count zero."""
    rows = list(column)
    out = np.zeros((len(rows), kinds), np.int64)
    for i, row in enumerate(rows):
        if row is not None and len(row):
            out[i, : len(row)] = row
    return out


class CatalogView:
    """Read-only access to a lake's catalog that can be refreshed while the lake is built;
    with a build's ``live`` handle, its live catalog while that build runs."""

    def __init__(self, lake: Lake, io_retry_deadline: float = 0.0, live: LiveCatalog | None = None) -> None:
        self.lake = lake
        self.live_catalog = live
        self.io_retry_deadline = io_retry_deadline
        self._lock = threading.Lock()
        self._version: int | None = None
        self._con = self._connect()

    def _connect(self) -> duckdb.DuckDBPyConnection:
        cursor = None if self.live_catalog is None else self.live_catalog.cursor(self.lake.writer_catalog_path)
        self._live = cursor is not None
        if cursor is not None:
            return cursor  # same process as the build driver: its live catalog
        # Never the writer's file: a long-lived reader holding it would lock out the next build.
        con, self._version = self._retrying(lambda: open_snapshot(self.lake))
        return con

    def _build_running(self) -> bool:
        return self.live_catalog is not None and self.live_catalog.is_open

    def _retrying(self, call: Callable[[], T]) -> T:
        return with_retries(call, what=f"reading the published catalog of {self.lake.url}",
                            deadline=self.io_retry_deadline)

    def refresh(self) -> bool:
        """Re-open the newest published snapshot if there is a newer one; returns whether it changed."""
        if self._live:
            if self._build_running():
                return True  # the live catalog is always current
            with self._lock:  # the build ended: move on to its final snapshot
                self._con = self._connect()
            return True
        pointer = self._retrying(lambda: read_pointer(self.lake))
        if pointer is None or pointer["version"] == self._version:
            return False
        with self._lock:
            old = self._con
            self._con, self._version = self._retrying(lambda: open_snapshot(self.lake))
            old.close()
        return True

    def execute(self, sql: str, params: Any = None) -> duckdb.DuckDBPyConnection:
        """Run SQL on the current view (thread-safe)."""
        if self._live and not self._build_running():
            self.refresh()
        with self._lock:
            cursor = self._con.cursor()
        return cursor.execute(sql, params) if params is not None else cursor.execute(sql)

    def named(self, name: str, params: Any = None) -> duckdb.DuckDBPyConnection:
        """Run a named query of catalog/queries.sql."""
        return self.execute(query(name), params)

    def dataset(self, name: str, plan_key: str | None = None) -> DatasetChunks:
        """The committed prefix of dataset ``name``; with a packing ``plan_key``, the prefix of
        chunks whose example counts under that plan are kept, with those counts."""
        plan = self.named("reader_dataset", {"name": name}).fetchone()
        if plan is None:
            raise CatalogError(
                f"dataset {name!r} is not in the lake {self.lake.url}: build it first "
                "(lakeloader build CONFIG)"
            )
        fingerprint, token_type, planned, prefix, source = plan
        kinds = self.named("reader_dataset_fields", {"name": name}).fetchone()[0]
        examples = None
        if plan_key is not None:
            examples = self.named("reader_chunk_examples", {"name": name, "plan_key": plan_key,
                                                            "prefix": prefix}).fetchnumpy()
            counted = examples["global_index"]
            # The prefix ends at the first chunk without counts.
            gaps = np.flatnonzero(counted != np.arange(len(counted)))
            prefix = min(prefix, int(gaps[0]) if len(gaps) else len(counted))
        column = self.named("reader_chunks", {"name": name, "prefix": prefix}).fetchnumpy()
        return DatasetChunks(
            name=name, fingerprint=fingerprint, complete=prefix == planned, planned=int(planned),
            paths=column["path"].astype(object), num_docs=column["num_docs"].astype(np.int64),
            num_tokens=column["num_tokens"].astype(np.int64), num_bytes=column["num_bytes"].astype(np.int64),
            checksums=column["checksum"].astype(object), shard_index=column["shard_index"].astype(np.int64),
            token_type=token_type, num_parts=self._chunk_parts(name, prefix, len(kinds)),
            num_examples=None if examples is None else examples["num_examples"][:prefix].astype(np.int64),
            filtered=source is not None,
        )

    def _chunk_parts(self, name: str, prefix: int, kinds: int) -> np.ndarray:
        """Parts of each kind of the prefix's chunks, ``[prefix, kinds]`` (empty chunks: zeros)."""
        rows = self.named("reader_chunk_parts", {"name": name, "prefix": prefix}).fetchnumpy()
        out = np.zeros((prefix, kinds), np.int64)
        out[rows["global_index"].astype(np.int64), rows["kind"].astype(np.int64)] = rows["count"]
        return out

    def selection(self, name: str, global_index: int, row_group: int) -> np.ndarray:
        """The documents (int64 indices within the row group, ascending) that chunk
        ``global_index`` of dataset ``name``, defined by a filter, selects from row group
        ``row_group`` of its file."""
        row = self.named("reader_selection", {"name": name, "global_index": global_index,
                                              "row_group": row_group}).fetchone()
        if row is None:
            raise CatalogError(f"chunk {global_index} of dataset {name!r} has no selection of row group {row_group} "
                               f"in the catalog of {self.lake.url}: the catalog is damaged; build the lake again")
        return np.asarray(row[0], np.int64)

    def chunk_selection(self, name: str, global_index: int) -> np.ndarray:
        """The documents (int64 indices within the file, ascending) that chunk ``global_index`` of
        dataset ``name``, defined by a filter, selects from its file."""
        rows = self.named("chunk_selection", {"name": name, "global_index": global_index}).fetchall()
        docs = [first + np.asarray(selected, np.int64) for _, first, selected in rows]
        return np.concatenate(docs) if docs else np.zeros(0, np.int64)

    def plan_registered(self, name: str, plan_key: str) -> bool:
        """Whether a build keeps per-chunk counts of packing plan ``plan_key`` for ``name``."""
        return bool(self.named("packing_plan_registered", {"name": name, "plan_key": plan_key}).fetchone()[0])

    def row_groups(self, name: str, global_index: int) -> dict[str, np.ndarray]:
        """First doc/token and counts of each row group of one committed chunk."""
        return self.named("reader_row_groups", {"name": name, "global_index": global_index}).fetchnumpy()

    def row_groups_of(self, name: str, global_indexes: list[int]) -> dict[int, dict[str, np.ndarray]]:
        """:meth:`row_groups` of several committed chunks, from one query."""
        rows = self.named("reader_row_groups_of", {"name": name, "global_indexes": global_indexes}).fetchnumpy()
        index = np.asarray(rows["global_index"], np.int64)
        bounds = np.searchsorted(index, np.asarray(global_indexes, np.int64), side="left").tolist()
        ends = np.searchsorted(index, np.asarray(global_indexes, np.int64), side="right").tolist()
        return {chunk: {k: np.asarray(v)[a:b] for k, v in rows.items() if k != "global_index"}
                for chunk, a, b in zip(global_indexes, bounds, ends)}

    def wait_for(self, name: str, chunk: int, timeout: float, plan_key: str | None = None) -> DatasetChunks:
        """Block until chunk ``chunk`` of ``name`` is committed or the dataset is complete."""
        deadline = time.monotonic() + timeout
        announced = False
        while True:
            chunks = self.dataset(name, plan_key)
            if chunk < chunks.committed or chunks.complete:
                return chunks
            if not announced:
                log.info("waiting for chunk %d of dataset %r to be committed (%s; loader.wait_timeout %gs)",
                         chunk, name, chunks.describe_prefix(), timeout)
                announced = True
            if time.monotonic() > deadline:
                raise ChunkWaitTimeout(
                    f"waited {timeout:g}s for chunk {chunk} of dataset {name!r} in lake {self.lake.url}, "
                    f"but {chunks.describe_prefix()}. Is its "
                    "build running? Check with `lakeloader status CONFIG`, or raise loader.wait_timeout."
                )
            time.sleep(POLL_SECONDS)
            self.refresh()

    def close(self) -> None:
        """Close the connection."""
        self._con.close()
