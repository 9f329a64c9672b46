"""A lake opened for queries: catalog connections (live, local or the published snapshot), SQL and status."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import duckdb
import pandas as pd

from lakeloader.catalog.documents import (
    DocumentLengths,
    document_stats,
    image_stats,
    length_histogram,
    mentions_documents,
    register_documents,
    scan_failure,
)
from lakeloader.catalog.identity import check_own_plans_in
from lakeloader.catalog.location import LakeLocation
from lakeloader.catalog.snapshot import open_snapshot
from lakeloader.catalog.sql import ALLOWED_SQL, STATUS_TABLES, check_read_only, query, run_bounded
from lakeloader.catalog.stale import stale_chunk_folders
from lakeloader.catalog.store import LiveCatalog, catalog_failure, connect_reader, is_damaged_catalog
from lakeloader.config import DEFAULT_IO_RETRY_DEADLINE, Config, SqlConfig, load_config
from lakeloader.contracts.errors import (
    CatalogError,
    CatalogLockedError,
    CatalogNotPublishedError,
    LakeloaderError,
    QueryLimitError,
)
from lakeloader.storage import missing_bucket, with_retries
from lakeloader.tokenizer import LazyTokenizer, lazy_tokenizer_file, lazy_tokenizer_text

log = logging.getLogger(__name__)
T = TypeVar("T")


class Lake(LakeLocation):
    """A lake opened for queries: catalog connections, SQL, status and its tokenizer."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 io_retry_deadline: float = DEFAULT_IO_RETRY_DEADLINE, sql: SqlConfig | None = None,
                 config_file: str | None = None, datasets: Sequence[str] | None = None,
                 config: Config | None = None) -> None:
        """``sql``: the limits of its catalog connections and queries (the config's ``sql``
        section); ``config_file``: the config they come from, named by errors about them;
        ``datasets``: the config's datasets, those ``status`` and ``stats`` answer for unless
        asked for the whole lake (None: a lake opened by its path, every dataset); ``config``:
        the config defining them (then ``status`` and ``stats`` refuse a dataset whose plan in the
        lake is another config's definition: ``catalog/identity.py``)."""
        super().__init__(url, storage_options, io_retry_deadline)
        self.datasets = None if datasets is None else tuple(datasets)
        self.config = config
        self.sql_config = sql or SqlConfig()
        self._limits_from = (config_file if config_file else
                             "the lake's config (given a lake's path instead, lakeloader uses the defaults)")

    def connect(self, *, sandboxed: bool = False, live: LiveCatalog | None = None) -> duckdb.DuckDBPyConnection:
        """A read-only catalog connection: a local lake's catalog file when no build holds it,
        else the newest published snapshot, opened by ``connect_reader`` (no SQL stored in the
        file runs; no other file, network or extension is reachable). Given the ``live`` handle
        of a build running in this process, it is that build's live connection while the build
        holds it, unless ``sandboxed``: then its published snapshot."""
        path = self.writer_catalog_path
        if live is not None and not sandboxed:  # the writer's connection can write and reach files
            cursor = live.cursor(path)
            if cursor is not None:
                return cursor
        if self.is_local and os.path.exists(path):  # remote: this host's copy may be stale
            try:
                return connect_reader(path, sql=self.sql_config)
            except CatalogLockedError:
                log.info("catalog is being written by a build; reading the published snapshot")
        try:
            return with_retries(lambda: open_snapshot(self, sql=self.sql_config)[0], deadline=self.io_retry_deadline,
                                what=f"reading the published catalog of {self.describe()}")
        except CatalogNotPublishedError as exc:   # nothing published, or no bucket to publish in
            missing = missing_bucket(self.fs, self.root, f"lake {self.describe()}")
            if missing is None:
                raise
            raise missing from exc

    def catalog_damage(self, exc: duckdb.Error) -> LakeloaderError | None:
        """The one-line error (with the ``--recover-catalog`` hint) for a query that found a local
        lake's catalog file damaged (a block failing its checksum, the file cut short); None for
        any other error."""
        path = self.writer_catalog_path
        return catalog_failure(path, exc) if self.is_local and is_damaged_catalog(path, exc) else None

    def tokenizer(self, con: Any, datasets: Sequence[str]) -> LazyTokenizer:
        """The lake's copy of the tokenizer that built ``datasets`` (``con``: a catalog connection
        or cursor): its special tokens' ids are read without building it, the rest on first use."""
        row = con.execute(query("tokenizer_path"), {"datasets": list(datasets)}).fetchone()
        return self.tokenizer_at(row[0] if row else None, datasets)

    def tokenizer_at(self, path: str | None, datasets: Sequence[str]) -> LazyTokenizer:
        """The lake's tokenizer copy at the lake-relative ``path`` the catalog names for
        ``datasets`` (None: the lake has none of them, an error saying so)."""
        if path is None:
            raise CatalogError(f"the lake {self.url} has none of the datasets {list(datasets)}: build them first")
        if self.is_local:
            local = self.path_of(path)
            stat = os.stat(local)
            return lazy_tokenizer_file(local, stat.st_size, stat.st_mtime_ns)
        return lazy_tokenizer_text(self.fs.cat_file(self.path_of(path)).decode())

    def sql(self, statement: str, params: list[Any] | dict[str, Any] | None = None,
            relations: Mapping[str, pd.DataFrame] | None = None) -> pd.DataFrame:
        """Run one read-only query (``ALLOWED_SQL``) against the catalog and return the result as
        a DataFrame. Anything else (writes, other files, network, extensions, settings) is refused
        with ``CatalogError`` and changes nothing. It runs within ``sql.memory_limit`` and
        ``sql.timeout_s`` (``QueryLimitError`` past them), and Ctrl-C interrupts it.
        ``relations``: more tables the query may read by name (a run's ``run_segments``, say)."""
        check_read_only(statement)
        with self._reader(documents=mentions_documents(statement)) as con:
            for name, frame in (relations or {}).items():
                con.register(name, frame)

            def run() -> pd.DataFrame:
                result = con.execute(statement, params) if params else con.execute(statement)
                return integer_columns(result.df(), result.description)
            return self._bounded(con, run)

    def stats(self, by: str | None = None, whole_lake: bool = False) -> pd.DataFrame:
        """Documents, tokens and document-length percentiles (p50, p90, p99, max) per dataset, or
        per dataset and value of ``by`` (a column of the ``documents`` view, e.g. a metadata field):
        of the config's datasets, or of every dataset of the lake with ``whole_lake``. Per dataset
        (without ``by``), when some dataset stores images: their counts, bytes and sizes too
        (:func:`image_stats`; 0 and null for the datasets without)."""
        with self._reader(documents=True, whole_lake=whole_lake) as con:
            stats = self._bounded(con, lambda: document_stats(con, by))
            images = self._bounded(con, lambda: image_stats(con)) if by is None else None
        if images is None or images.empty:
            return stats
        merged = stats.merge(images, on="dataset", how="left")
        counts = ["images", "distinct_images", "image_bytes"]
        merged[counts] = merged[counts].fillna(0).astype("int64")
        return merged

    def document_lengths(self, by: str | None = None, whole_lake: bool = False) -> DocumentLengths:
        """``stats(by, whole_lake)`` and the histogram of the same documents' lengths (documents
        per quarter-octave bin, per dataset and value of ``by``), read through one connection:
        what a length plot draws."""
        with self._reader(documents=True, whole_lake=whole_lake) as con:
            return self._bounded(con, lambda: DocumentLengths(document_stats(con, by), length_histogram(con, by)))

    def _bounded(self, con: duckdb.DuckDBPyConnection, call: Callable[[], T]) -> T:
        """``call()``, queries on ``con``, stopped after ``sql.timeout_s`` or at Ctrl-C."""
        return run_bounded(con, call, self.sql_config.timeout_s, self._limits_from)

    @contextlib.contextmanager
    def _reader(self, *, documents: bool, whole_lake: bool = True) -> Iterator[duckdb.DuckDBPyConnection]:
        """A sandboxed catalog connection (with the ``documents`` view if asked), its DuckDB
        errors as ``CatalogError`` (chunk files that cannot be read as ``ChunkIntegrityError``, one
        that needs more than ``sql.memory_limit`` as ``QueryLimitError``)."""
        con = self.connect(sandboxed=True)
        try:
            if not whole_lake:
                self._check_own_plans(con)
            if documents:
                register_documents(con, self, None if whole_lake else self.datasets)
            yield con
        except duckdb.OutOfMemoryException as exc:
            raise QueryLimitError(
                f"the query needs more memory than sql.memory_limit ({self.sql_config.memory_limit:,} bytes) "
                f"allows and was stopped: raise sql.memory_limit in {self._limits_from}, or ask for less") from exc
        except (duckdb.PermissionException, duckdb.InvalidInputException) as exc:
            raise scan_failure(exc) or CatalogError(f"SQL error: {exc}\nlakeloader sql runs {ALLOWED_SQL}") from exc
        except duckdb.Error as exc:
            raise self.catalog_damage(exc) or scan_failure(exc) or CatalogError(f"SQL error: {exc}") from exc
        finally:
            con.close()

    def _check_own_plans(self, con: duckdb.DuckDBPyConnection) -> None:
        """A CatalogError unless the lake holds the config's own definition of each of its
        datasets the lake has (nothing to check for a lake opened by its path)."""
        if self.config is not None and self.datasets is not None:
            check_own_plans_in(con, self.config, self.datasets, self.url)

    def status(self, whole_lake: bool = False, shards_shown: int | None = None
               ) -> dict[str, pd.DataFrame]:   # keys: STATUS_TABLES
        """Per-dataset and per-shard progress, the recent builds and the stale chunk folders of
        replaced dataset plans (``stale_folders``; ``lakeloader gc`` removes them), as DataFrames:
        of the config's datasets, or of every dataset of the lake with ``whole_lake`` (the builds:
        every build of the lake). Its time does not grow with the number of chunks (the catalog's
        progress counters), nor, given ``shards_shown``, with the number of shards: then the
        shards of a lake of more than that many are only the first that many not complete, and
        the frame's ``attrs`` ``shards`` and ``complete`` count them all."""
        con = self.connect()
        try:
            if not whole_lake:
                self._check_own_plans(con)
            tables = {name: con.execute(query(q)).df() for name, q in
                      (("datasets", "dataset_status"), ("builds", "recent_builds"))}
            datasets = list(self.datasets) if self.datasets is not None and not whole_lake else None
            tables["shards"] = self._shards(con, datasets, shards_shown)
            tables["stale_folders"] = stale_chunk_folders(self, con)
            if datasets is not None:
                for name, column in (("datasets", "name"), ("shards", "dataset"), ("stale_folders", "dataset")):
                    attrs = tables[name].attrs
                    tables[name] = tables[name][tables[name][column].isin(datasets)].reset_index(drop=True)
                    tables[name].attrs.update(attrs)
            return {name: tables[name] for name in STATUS_TABLES}
        except duckdb.Error as exc:
            raise self.catalog_damage(exc) or exc
        finally:
            con.close()

    @staticmethod
    def _shards(con: duckdb.DuckDBPyConnection, datasets: list[str] | None, shown: int | None) -> pd.DataFrame:
        """The shards of ``Lake.status`` of ``datasets`` (None: every dataset): every one, or with
        ``shown`` and more shards than that, the first ``shown`` not complete, counted in ``attrs``."""
        if shown is None:
            return con.execute(query("shard_status")).df()
        total, complete = con.execute(query("shard_totals"), {"datasets": datasets}).fetchone()
        if total <= shown:
            frame = con.execute(query("shard_status")).df()
        else:
            frame = con.execute(query("shard_status_unfinished"), {"datasets": datasets, "limit": shown}).df()
        frame.attrs.update(shards=int(total), complete=int(complete))
        return frame


_WIDE_INTEGER = re.compile(r"^(U?HUGEINT|DECIMAL\(\d+,\s*0\))$")
_EXACT_IN_FLOAT = 2**53


def integer_columns(frame: pd.DataFrame, description: Sequence[Sequence[Any]] | None) -> pd.DataFrame:
    """``frame`` with its HUGEINT and DECIMAL(p,0) columns (what DuckDB's ``sum()`` of integers
    returns; pandas receives them as floats) as int64 (nullable ``Int64`` where NULLs occur)
    when every value fits, so integer sums stay integers in pandas, CSV and JSON."""
    for number, column in enumerate(description or ()):
        values = frame.iloc[:, number]
        if not _WIDE_INTEGER.match(str(column[1])) or values.dtype.kind != "f":
            continue
        present = values.dropna()
        if len(present) and not (present.abs() < _EXACT_IN_FLOAT).all():
            continue  # beyond 2**53 the float is no longer exact: leave it as it came
        frame.isetitem(number, values.astype("Int64" if len(present) < len(values) else "int64"))
    return frame


def open_lake(config_or_lake: Config | str | os.PathLike[str],
              storage_options: dict[str, Any] | None = None) -> Lake:
    """The lake of a config (object or YAML path: status and stats answer for its datasets) or a
    lake path/URL (for every dataset)."""
    if not isinstance(config_or_lake, Config) and os.fspath(config_or_lake).endswith((".yaml", ".yml")):
        config_or_lake = load_config(config_or_lake)
    if isinstance(config_or_lake, Config):
        config = config_or_lake
        return Lake(config.lake, config.storage_options, config.io_retry_deadline, config.sql, config.source_file,
                    list(config.datasets), config)
    text = os.fspath(config_or_lake)
    lake = Lake(text, storage_options)
    if lake.is_local and not os.path.isdir(lake.root):
        raise CatalogError(f"no lake at {text}: give a config file (.yaml) or a lake folder/URL")
    return lake
