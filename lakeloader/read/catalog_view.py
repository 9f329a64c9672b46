"""What a reader knows of the catalog: each dataset's committed chunks as numpy arrays.

Readers given a build's live-catalog handle (in the build driver's process) share its catalog
connection while it runs; all others read the published snapshot and refresh it when they need
chunks they have not seen committed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import duckdb
import numpy as np
import pyarrow as pa

from lakeloader.catalog.identity import DefinitionRecord, check_own_plans, definition_records
from lakeloader.catalog.lake import Lake
from lakeloader.catalog.reader_index import ReaderIndex
from lakeloader.catalog.snapshot import connect_newest, connect_pointer, open_reader_index, read_pointer
from lakeloader.catalog.sql import query
from lakeloader.catalog.store import LiveCatalog, define_views
from lakeloader.config import Config
from lakeloader.contracts.errors import CatalogError, LakeloaderError
from lakeloader.read.lru import LRU
from lakeloader.storage import with_retries

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25
RECORDS_KEPT = 1 << 16   # chunk records (path, size, checksum, shard) kept per view
SELECTIONS_KEPT = 256    # chunks of filtered datasets whose selected documents are kept (arrays of them)
T = TypeVar("T")


class ChunkWaitTimeout(LakeloaderError):
    """A reader waited longer than ``loader.wait_timeout`` for a chunk to be committed."""


@dataclasses.dataclass(frozen=True)
class ChunkRecord:
    """Where one committed chunk's file is and what it must be (fetched only for chunks read)."""

    path: str               # lake-relative path of the chunk file
    num_bytes: int
    checksum: str           # sha256 of the file
    shard_index: int


@dataclasses.dataclass(frozen=True)
class DatasetChunks:
    """The committed prefix of one dataset's chunks, in global order: per-chunk counts as int64
    arrays (what seeking needs); each chunk's file record is looked up only when it is read."""

    name: str
    fingerprint: str
    complete: bool                 # every planned chunk is committed
    planned: int                   # chunks in the plan
    num_docs: np.ndarray           # int64 per chunk
    num_tokens: np.ndarray         # int64 per chunk
    token_type: str
    num_parts: np.ndarray | None   # int64 [chunks, kinds]: parts of each kind (None: not asked for)
    num_examples: np.ndarray | None = None   # int64 per chunk under a packing plan (pack | pad)
    filtered: bool = False         # defined by a filter: chunk files hold more than its documents
    records: Callable[[int], ChunkRecord] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def committed(self) -> int:
        """Number of chunks in the committed prefix."""
        return len(self.num_docs)

    @functools.cached_property
    def stored_bytes(self) -> int:
        """Bytes of the committed prefix's tokens as stored (what the row-group cache measures)."""
        return int(self.num_tokens.sum()) * np.dtype(self.token_type).itemsize

    def record(self, index: int) -> ChunkRecord:
        """Path, size, checksum and shard of committed chunk ``index`` (from the catalog, kept)."""
        if self.records is None or not 0 <= index < self.committed:
            raise IndexError(f"chunk {index} of dataset {self.name!r} is not in its committed prefix "
                             f"({self.committed} chunks)")
        return self.records(index)

    @property
    def shard_index(self) -> ChunkShards:
        """Shard of each committed chunk, by global index (looked up per chunk)."""
        return ChunkShards(self)

    def describe_prefix(self) -> str:
        """The committed prefix in words, for wait messages (a dataset may have none yet)."""
        if not self.committed:
            return f"none of its {self.planned} planned chunks is committed yet"
        return f"only chunks 0..{self.committed - 1} of {self.planned} are committed"


class ChunkShards(Mapping[int, int]):
    """Shard index of each committed chunk of a dataset, by global index, looked up per chunk."""

    def __init__(self, chunks: DatasetChunks) -> None:
        self.chunks = chunks

    def __getitem__(self, index: int) -> int:
        return self.chunks.record(int(index)).shard_index

    def __len__(self) -> int:
        return self.chunks.committed

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.chunks.committed))


def _in_global_order(table: pa.Table, url: str, name: str) -> pa.Table:
    """The rows of reader_chunks (every planned chunk of dataset ``name`` of lake ``url``) in
    global order; a CatalogError unless their global indexes are 0 to one less than their number."""
    global_index = table.column("global_index").to_numpy()
    planned = len(global_index)
    if planned and global_index[0] == 0 and global_index[-1] == planned - 1 and (
            np.diff(global_index) == 1).all():
        return table   # the usual case: a scan in the order the plan inserted them
    if (int(global_index.min()) < 0 or int(global_index.max()) >= planned
            or int(np.bincount(global_index, minlength=planned).max()) > 1):
        raise CatalogError(f"the catalog of {url} lists the {planned} chunks of dataset {name!r} "
                           "under global indexes other than 0 to one less than their number: it is damaged; "
                           "restore it with `lakeloader build CONFIG --recover-catalog`")
    row = np.empty(planned, np.int64)   # row of the table holding each chunk
    row[global_index] = np.arange(planned)
    return table.take(row)


def part_lists(column: pa.ListArray | pa.ChunkedArray, kinds: int) -> np.ndarray:
    """A LIST column of per-kind counts as an int64 ``[rows, kinds]`` matrix without a Python
    loop over rows; missing or empty lists count zero."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], pa.list_(pa.int64()))
    out = np.zeros((len(column), kinds), np.int64)
    offsets = column.offsets.to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    values = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]] if len(column) else np.zeros(0)
    if column.null_count == 0 and (lengths == kinds).all():   # the usual case: every list whole
        out[:] = values.reshape(len(column), kinds)
        return out
    rows = np.repeat(np.arange(len(column)), lengths)
    position = np.arange(len(rows)) - np.repeat(offsets[:-1] - offsets[0], lengths)
    out[rows, position] = values
    return out


def part_matrix(column: Any, kinds: int) -> np.ndarray:
    """:func:`part_lists` of a column fetched as numpy (an object array of lists, or None) or
    as Arrow."""
    if not isinstance(column, (pa.Array, pa.ChunkedArray)):
        column = pa.array(list(column), type=pa.list_(pa.int64()))
    return part_lists(column, kinds)


@dataclasses.dataclass
class _Snapshot:
    """One published catalog snapshot: its reader index (None for a snapshot without one) and a
    connection to it, opened the first time a question the index does not answer is asked (or at
    once without an index); closed once retired and left by its readers."""

    pointer: dict[str, Any]
    index: ReaderIndex | None
    con: duckdb.DuckDBPyConnection | None = None
    analyst_views: bool = False   # catalog/views.sql defined on it (~18 ms: only once SQL of a user's runs)
    readers: int = 0              # blocks of CatalogView.reading on it now
    retired: bool = False

    @property
    def version(self) -> int:
        return int(self.pointer["version"])


FetchOne = duckdb.DuckDBPyConnection.fetchone
FetchAll = duckdb.DuckDBPyConnection.fetchall
FetchNumpy = duckdb.DuckDBPyConnection.fetchnumpy


class CatalogView:
    """Read-only access to a lake's catalog that can be refreshed while the lake is built;
    with a build's ``live`` handle, its live catalog while that build runs.

    Every query is run and fetched inside :meth:`reading`: neither a build ending nor a refresh
    closes a connection that a query of another thread is still using."""

    def __init__(self, lake: Lake, io_retry_deadline: float = 0.0, live: LiveCatalog | None = None) -> None:
        self.lake = lake
        self.live_catalog = live
        self.io_retry_deadline = io_retry_deadline
        self._lock = threading.Lock()
        self._records: LRU[tuple[str, int], ChunkRecord] = LRU(RECORDS_KEPT)
        self._selections: LRU[tuple[str, int], dict[int, tuple[int, np.ndarray]]] = LRU(SELECTIONS_KEPT)
        # Never the writer's file: a long-lived reader holding it would lock out the next build.
        self._snapshot = None if self._build_running() else self._open_snapshot()

    def _build_running(self) -> bool:
        return self.live_catalog is not None and self.live_catalog.is_open

    def _retrying(self, call: Callable[[], T]) -> T:
        return with_retries(call, what=f"reading the published catalog of {self.lake.url}",
                            deadline=self.io_retry_deadline)

    def _open_snapshot(self, previous: _Snapshot | None = None) -> _Snapshot:
        """The newest snapshot: its reader index (reusing the base of ``previous``'s where it is
        the same), or (without one) a connection to it."""
        index = previous.index if previous is not None else None
        snapshot = _Snapshot(*self._retrying(lambda: open_reader_index(self.lake, index)))
        if snapshot.index is None:
            self._connect(snapshot)
        return snapshot

    def _connect(self, snapshot: _Snapshot) -> None:
        """Give ``snapshot`` its connection; if its file was pruned since it was opened, the
        newest snapshot's (its counts and records only grow: committed chunks never change)."""
        try:
            snapshot.con = self._retrying(lambda: connect_pointer(self.lake, snapshot.pointer, analyst_views=False))
        except FileNotFoundError:
            log.info("catalog snapshot %s of %s was pruned before it was queried; reading the newest",
                     snapshot.pointer["file"], self.lake.url)
            snapshot.con, snapshot.pointer = self._retrying(lambda: connect_newest(self.lake, analyst_views=False))
            snapshot.index = None   # the connection's version answers from now on

    def reader_index(self) -> ReaderIndex | None:
        """The reader index of the snapshot the view reads; None while it follows a running build
        (its live catalog answers) or for a snapshot without one."""
        if self._build_running():
            return None
        with self._lock:
            if self._snapshot is None:   # the build this view followed ended: its final snapshot
                self._snapshot = self._open_snapshot()
            return self._snapshot.index

    def refresh(self) -> bool:
        """Re-open the newest published snapshot if there is a newer one; returns whether the
        view may have changed (always while it follows a running build: that is always current)."""
        if self._build_running():
            return True
        if self._snapshot is not None:
            pointer = self._retrying(lambda: read_pointer(self.lake))
            if pointer is None or pointer["version"] == self._snapshot.version:
                return False
        newer = self._open_snapshot(self._snapshot)
        with self._lock:
            old, self._snapshot = self._snapshot, newer
            if old is not None:
                self._retire(old)
        return True

    @contextlib.contextmanager
    def reading(self, analyst_views: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor for one query and its fetch (thread-safe): of the live catalog while the build
        this view follows runs, else of the newest snapshot it has opened; either stays open
        until the block ends. ``analyst_views``: with the views of ``lakeloader sql`` too."""
        if self.live_catalog is not None:
            with self.live_catalog.reading(self.lake.writer_catalog_path) as live:
                if live is not None:   # it has every view
                    yield live
                    return
        with self._lock:
            if self._snapshot is None:   # the build this view followed ended: its final snapshot
                self._snapshot = self._open_snapshot()
            snapshot = self._snapshot
            if snapshot.con is None:
                self._connect(snapshot)
            if analyst_views and not snapshot.analyst_views:
                define_views(snapshot.con, analyst=True)
                snapshot.analyst_views = True
            cursor = snapshot.con.cursor()
            snapshot.readers += 1
        try:
            yield cursor
        finally:
            cursor.close()
            with self._lock:
                snapshot.readers -= 1
                if snapshot.retired and not snapshot.readers and snapshot.con is not None:
                    snapshot.con.close()

    def _retire(self, snapshot: _Snapshot) -> None:
        """Close ``snapshot`` once its readers are done (call under the lock)."""
        snapshot.retired = True
        if not snapshot.readers and snapshot.con is not None:
            snapshot.con.close()

    def execute(self, sql: str, params: Any = None) -> pa.Table:
        """Run SQL on the current view, with every table and view of ``lakeloader sql``, and
        return its result (thread-safe)."""
        with self.reading(analyst_views=True) as cursor:
            return cursor.sql(sql, params=params).to_arrow_table()

    def named(self, name: str, params: Any = None, fetch: Callable[[duckdb.DuckDBPyConnection], T] = FetchAll) -> T:
        """Run a named query of catalog/queries.sql and return ``fetch`` of its result (thread-safe):
        ``FetchOne``, ``FetchAll`` or ``FetchNumpy``."""
        with self.reading() as cursor:
            return fetch(cursor.execute(query(name), params) if params is not None else cursor.execute(query(name)))

    def named_table(self, name: str, params: dict[str, Any]) -> pa.Table:
        """The result of a named query of catalog/queries.sql as an Arrow table (thread-safe)."""
        with self.reading() as cursor:
            return cursor.sql(query(name), params=params).to_arrow_table()

    def dataset(self, name: str, plan_key: str | None = None, part_counts: bool = True) -> DatasetChunks:
        """The committed prefix of dataset ``name``; with a packing ``plan_key``, the prefix of
        chunks whose example counts under that plan are kept, with those counts. Per-chunk counts
        only (int64 arrays, a few queries whatever the number of chunks; the parts of each kind
        only with ``part_counts``); the paths and checksums of chunks come with the row groups of
        the chunks a batch reads (:meth:`row_groups_of`)."""
        index = self.reader_index()
        if index is not None:
            plan, table = index.plan(name), index.chunks(name)
        else:
            plan = self.named("reader_dataset", {"name": name}, FetchOne)
            table = self.named_table("reader_chunks", {"name": name, "part_counts": part_counts})
        planned = table.num_rows
        if plan is None or not planned:
            raise CatalogError(
                f"dataset {name!r} is not in the lake {self.lake.url}: build it first "
                "(lakeloader build CONFIG)"
            )
        fingerprint, token_type, kinds, source = plan
        table = _in_global_order(table, self.lake.url, name)
        # The committed prefix (catalog/prefix.sql): the chunks before the first one not committed.
        uncommitted = np.flatnonzero(~table.column("committed").to_numpy())
        prefix = int(uncommitted[0]) if len(uncommitted) else planned
        examples = None
        if plan_key is not None:
            examples = index.examples(name, plan_key, prefix) if index is not None else self.named(
                "reader_chunk_examples", {"name": name, "plan_key": plan_key, "prefix": prefix}, FetchNumpy)
            counted = examples["global_index"]
            # The prefix ends at the first chunk without counts.
            gaps = np.flatnonzero(counted != np.arange(len(counted)))
            prefix = min(prefix, int(gaps[0]) if len(gaps) else len(counted))
        table = table.slice(0, prefix)   # (the counts of chunks not committed yet are NULL)
        num_parts = part_lists(table.column("num_parts"), len(kinds)) if part_counts else None
        return DatasetChunks(
            name=name, fingerprint=fingerprint, complete=prefix == planned, planned=int(planned),
            num_docs=table.column("num_docs").to_numpy().astype(np.int64, copy=False),
            num_tokens=table.column("num_tokens").to_numpy().astype(np.int64, copy=False),
            token_type=token_type, num_parts=num_parts,
            num_examples=None if examples is None else examples["num_examples"][:prefix].astype(np.int64),
            filtered=source is not None, records=functools.partial(self.chunk_record, name),
        )

    def tokenizer_path(self, datasets: Sequence[str]) -> str | None:
        """Lake-relative path of the tokenizer copy that built ``datasets`` (None: the catalog has
        none of them)."""
        index = self.reader_index()
        if index is not None:
            return index.tokenizer_path(datasets)
        row = self.named("tokenizer_path", {"datasets": list(datasets)}, FetchOne)
        return None if row is None else row[0]

    def plan_of(self, name: str) -> tuple[str, str | None] | None:
        """The fingerprint of dataset ``name``'s plan in the catalog and its source dataset (None:
        not defined by a filter); None when the catalog has no plan of the name."""
        index = self.reader_index()
        row = index.plan(name) if index is not None else self.named("reader_dataset", {"name": name}, FetchOne)
        return None if row is None else (str(row[0]), row[3])

    def plan_growth(self, name: str) -> dict[str, tuple[str, int]]:
        """The growths the catalog recorded of dataset ``name``: each grown plan's fingerprint ->
        the plan it extends and that plan's chunks (none for a catalog from before they were)."""
        try:
            rows = self.named("plan_growth", {"name": name})
        except duckdb.CatalogException:   # a catalog without the table: nothing recorded
            return {}
        return {str(grown): (str(older), int(chunks)) for grown, older, chunks in rows}

    def definitions(self, name: str) -> list[DefinitionRecord]:
        """The definitions of dataset ``name`` the catalog recorded, each with the plan it was last
        built as and the config that built it (none for a catalog from before they were recorded)."""
        index = self.reader_index()
        if index is not None:
            return index.definitions(name)
        with self.reading() as cursor:
            return definition_records(cursor, name)

    def check_own_plans(self, config: Config, names: Sequence[str]) -> None:
        """A CatalogError unless the lake holds ``config``'s own definition of each of ``names``
        (and of their sources): see :mod:`lakeloader.catalog.identity`."""
        check_own_plans(config, names, self.lake.url, self.plan_of, self.definitions)

    def is_filtered(self, name: str) -> bool:
        """Whether dataset ``name`` is defined by a filter of another (``from``, ``where``)."""
        index = self.reader_index()
        row = index.plan(name) if index is not None else self.named("dataset_source", {"name": name}, FetchOne)
        return row is not None and row[-1] is not None

    def selection(self, name: str, global_index: int, row_group: int) -> np.ndarray:
        """The documents (int64 indices within the row group, ascending) that chunk
        ``global_index`` of dataset ``name``, defined by a filter, selects from row group
        ``row_group`` of its file."""
        found = self._selections_of(name, global_index).get(row_group)
        if found is None:
            raise CatalogError(f"chunk {global_index} of dataset {name!r} has no selection of row group {row_group} "
                               f"in the catalog of {self.lake.url}: the catalog is damaged; build the lake again")
        return found[1]

    def chunk_selection(self, name: str, global_index: int) -> np.ndarray:
        """The documents (int64 indices within the file, ascending) that chunk ``global_index`` of
        dataset ``name``, defined by a filter, selects from its file."""
        docs = [first + selected for first, selected in self._selections_of(name, global_index).values()]
        return np.concatenate(docs) if docs else np.zeros(0, np.int64)

    def _selections_of(self, name: str, global_index: int) -> dict[int, tuple[int, np.ndarray]]:
        """Per row group of the file, in order: its first document in the file and the documents
        selected within it; one query per chunk, kept (a chunk's rows never change once committed)."""
        def fetch() -> dict[int, tuple[int, np.ndarray]]:
            rows = self.named("chunk_selection", {"name": name, "global_index": global_index})
            return {int(group): (int(first), np.asarray(selected, np.int64)) for group, first, selected in rows}

        return self._selections.get((name, global_index), fetch)

    def deduped_media(self) -> dict[str, str]:
        """Chunk file -> the media file a build's end rewrote for it (lake paths, ``media_files``);
        a chunk not named reads its own media file. From the reader index where it has them."""
        index = self.reader_index()
        found = index.media_files() if index is not None else None
        if found is not None:
            return found
        return {str(chunk): str(media) for chunk, media in self.named("deduped_media_files")}

    def plan_registered(self, name: str, plan_key: str) -> bool:
        """Whether a build keeps per-chunk counts of packing plan ``plan_key`` for ``name``."""
        index = self.reader_index()
        if index is not None:
            return index.plan_registered(name, plan_key)
        return bool(self.named("packing_plan_registered", {"name": name, "plan_key": plan_key}, FetchOne)[0])

    def chunk_record(self, name: str, global_index: int) -> ChunkRecord:
        """Path, size, checksum and shard of one committed chunk of ``name`` (kept: a committed
        chunk never changes; usually already learnt from :meth:`row_groups_of`)."""
        return self._records.get((name, global_index), lambda: self._fetch_record(name, global_index))

    def _fetch_record(self, name: str, global_index: int) -> ChunkRecord:
        index = self.reader_index()
        row = index.record(name, global_index) if index is not None else self.named(
            "reader_chunk_record", {"name": name, "global_index": global_index}, FetchOne)
        if row is None:
            raise CatalogError(f"chunk {global_index} of dataset {name!r} is not committed in the catalog of "
                               f"{self.lake.url}: was the lake re-planned while this reader ran? Open a new loader")
        path, size, checksum, shard = row
        return ChunkRecord(path, int(size), checksum, int(shard))

    def row_groups_of(self, name: str, global_indexes: list[int],
                      kinds: int | None = None) -> dict[int, dict[str, np.ndarray]]:
        """Counts (``num_docs``, ``num_tokens``, and with ``kinds`` ``num_parts``, an int64
        ``[row groups, kinds]`` matrix) and first document (``first_doc``, within the chunk) of
        each row group of committed chunks ``global_indexes``, in row-group order, from one
        lookup in the reader index (or one query) that also brings (and keeps) those chunks'
        records (:meth:`chunk_record`)."""
        index = self.reader_index()
        rows = index.row_groups_of(name, global_indexes, kinds is not None) if index is not None else self.named(
            "reader_row_groups_of", {"name": name, "global_indexes": global_indexes, "part_counts": kinds is not None},
            FetchNumpy)
        if kinds is None:
            del rows["num_parts"]   # (NULL: not read)
        else:
            rows["num_parts"] = part_matrix(rows["num_parts"], kinds)
        chunk_of_row = np.asarray(rows.pop("global_index"), np.int64)
        # A row group's first document follows its chunk's earlier row groups' documents (as the
        # writer stores it), counted here rather than read.
        num_docs = np.asarray(rows["num_docs"], np.int64)
        docs_before = np.cumsum(num_docs) - num_docs
        record = {k: rows.pop(k) for k in ("path", "num_bytes", "checksum", "shard_index")}
        wanted = np.asarray(global_indexes, np.int64)
        bounds = np.searchsorted(chunk_of_row, wanted, side="left").tolist()
        ends = np.searchsorted(chunk_of_row, wanted, side="right").tolist()
        for chunk, a, b in zip(global_indexes, bounds, ends):
            if b > a:
                self._records.get((name, chunk), lambda a=a: ChunkRecord(
                    str(record["path"][a]), int(record["num_bytes"][a]), str(record["checksum"][a]),
                    int(record["shard_index"][a])))
        return {chunk: {"first_doc": docs_before[a:b] - (docs_before[a] if b > a else 0),
                        **{k: np.asarray(v)[a:b] for k, v in rows.items()}}
                for chunk, a, b in zip(global_indexes, bounds, ends)}

    def wait_for(self, name: str, chunk: int, timeout: float, plan_key: str | None = None,
                 part_counts: bool = True) -> DatasetChunks:
        """Block until chunk ``chunk`` of ``name`` is committed or the dataset is complete
        (:meth:`dataset` then)."""
        deadline = time.monotonic() + timeout
        announced = False
        while True:
            chunks = self.dataset(name, plan_key, part_counts)
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
        """Close the snapshot connection (once queries of other threads on it are done)."""
        with self._lock:
            if self._snapshot is not None:
                self._retire(self._snapshot)
                self._snapshot = None
