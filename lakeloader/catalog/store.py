"""The catalog writer (the build driver's only connection) and read-only connections."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import functools
import itertools
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import duckdb
import pandas as pd
import pyarrow as pa

from lakeloader.catalog import progress
from lakeloader.catalog.changes import KEYED_TABLES, STATIC_TABLES, ChangeLog
from lakeloader.catalog.identity import replaced_definitions
from lakeloader.catalog.progress import commit_sums, counted, counted_views
from lakeloader.catalog.sql import query, sql_file
from lakeloader.config import SqlConfig
from lakeloader.contracts.chunk_file import IMAGE_ROW_FIELDS, ChunkResult, PlanStats
from lakeloader.contracts.errors import CatalogError, CatalogIntegrityError, CatalogLockedError, LakeloaderError
from lakeloader.contracts.media import media_path
from lakeloader.contracts.specs import MixtureSpec, PackingSpec
from lakeloader.index.mixture import mixture_rows
from lakeloader.plan.growth import BuiltPlan
from lakeloader.plan.planner import DatasetPlan
from lakeloader.plan.sources import readable_url, url_bytes, url_from_bytes
from lakeloader.storage import remove_quietly, write_failure

log = logging.getLogger(__name__)
# The rows a published version's deltas add to its base (catalog/delta.py ``Merged``): the chunks
# they replace, and per table they carry its rows.
Overlay = tuple[pa.Table, dict[str, pa.Table]]

SCHEMA_VERSION = "3"
# Schema versions the writer upgrades on open: 2, before the progress counters (counted then).
_UPGRADED_VERSIONS = ("2",)
# How long closing the build's catalog waits for a query on a cursor handed out of it to end.
CLOSE_WAIT_SECONDS = 60.0
_LOCK_PID = re.compile(r"PID (\d+)")
_TABLE = re.compile(r"^CREATE TABLE IF NOT EXISTS (\w+)", re.MULTILINE)
_TABLE_BODY = re.compile(r"^CREATE TABLE IF NOT EXISTS (\w+) \((.*?)^\);", re.MULTILINE | re.DOTALL)
_COLUMN = re.compile(r"^\s*(\w+)\s+[A-Z]")
_CONSTRAINTS = {"PRIMARY", "UNIQUE", "CHECK", "FOREIGN", "CONSTRAINT"}
# Tables a catalog written before them lacks, read as empty (their CREATE TABLE of schema.sql run
# in the reader's own in-memory database): views of views.sql read them.
_LATER_TABLES = ("chunk_images", "media_files")
_ADDED = re.compile(r"^ALTER TABLE (\w+) ADD COLUMN IF NOT EXISTS (\w+) ([\w\[\]]+);", re.MULTILINE)
# Readers' in-memory databases: no extension installed or loaded behind a query's back, no stored
# secrets read, and no spilling to disk (DuckDB's default folder is beside the database file).
_READER_CONFIG = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "allow_persistent_secrets": False,
    "temp_directory": "",
}


class LiveCatalog:
    """A handle on a build's live catalog for readers in the build's own process.

    Pass the same handle to ``build(config, live=handle)`` and to the readers that should follow
    that build (``Loader(config, catalog=handle)``, ``CatalogView(lake, live=handle)``,
    ``Lake.connect(live=handle)``): while the build holds its catalog they share its connection,
    always current; before it starts and after it ends they read as any other process does (the
    published snapshot). Readers given no handle always read as other processes do.

    The build releases its catalog only once no reader is inside :meth:`reading` (DuckDB refuses
    to close a connection while a cursor of it runs a call, and a cursor of a closed connection
    has lost its result); a connection from :meth:`cursor` closes with the build.
    """

    def __init__(self) -> None:
        self._writer: CatalogWriter | None = None
        self._changed = threading.Condition()
        self._reading = 0

    def attach(self, writer: CatalogWriter) -> None:
        """Make ``writer``'s catalog the live one (called by the build once its catalog is open)."""
        with self._changed:
            if self._writer is not None:
                raise LakeloaderError(
                    f"this live-catalog handle already follows the build of {self._writer.path}: one "
                    "handle follows one build at a time; create a LiveCatalog per build")
            self._writer = writer

    def detach(self) -> None:
        """The build releases its catalog: readers move on to its published snapshot. Returns
        once every reader inside :meth:`reading` has left it (queries of milliseconds)."""
        with self._changed:
            self._writer = None
            self._changed.wait_for(lambda: self._reading == 0)

    @property
    def is_open(self) -> bool:
        """Whether a build holds the live catalog now."""
        with self._changed:
            return self._writer is not None

    def cursor(self, path: str) -> duckdb.DuckDBPyConnection | None:
        """A cursor on the live catalog if a build holds it now, else None; ``path`` is the
        catalog file the reader means (an error if the handle follows another lake's build).
        It is closed when the build ends; readers that outlive the build use :meth:`reading`."""
        with self._changed:
            return self._new_cursor(path)

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[duckdb.DuckDBPyConnection | None]:
        """For one query and its fetch: a cursor on the live catalog if a build holds it now (the
        build keeps it open until the block ends), else None; ``path`` as for :meth:`cursor`."""
        with self._changed:
            cursor = self._new_cursor(path)
            self._reading += cursor is not None
        if cursor is None:
            yield None
            return
        try:
            yield cursor
        finally:
            cursor.close()
            with self._changed:
                self._reading -= 1
                self._changed.notify_all()

    def _new_cursor(self, path: str) -> duckdb.DuckDBPyConnection | None:
        writer = self._writer
        if writer is None:
            return None
        if os.path.abspath(writer.path) != os.path.abspath(path):
            raise LakeloaderError(
                f"the live-catalog handle follows the build of {writer.path}, but this reader "
                f"opens the catalog {path}: pass the handle only to readers of that build's lake")
        return writer.reader_source.cursor()   # under this handle's lock: one reader at a time


def is_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is Ctrl-C: a KeyboardInterrupt, or how DuckDB reports one that came while
    it ran a statement (it takes the signal and raises a plain RuntimeError "Query interrupted")."""
    return (isinstance(exc, (KeyboardInterrupt, duckdb.InterruptException))
            or (type(exc) is RuntimeError and str(exc) == "Query interrupted"))


def is_lock_error(exc: BaseException) -> bool:
    """Whether DuckDB refused to open a catalog file because another process holds its lock."""
    return isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower()


def _locked_error(path: str, exc: duckdb.Error) -> CatalogLockedError:
    pid = _LOCK_PID.search(str(exc))
    holder = f"process {pid.group(1)}" if pid else "another process"
    return CatalogLockedError(
        f"catalog {path} is in use by {holder} (another `lakeloader build` of this lake, or a "
        "process reading its catalog directly). Only one build may write a lake at a time: wait "
        "for it to finish or stop it; readers during a build use the published snapshot."
    )


@functools.cache
def catalog_tables() -> tuple[str, ...]:
    """Names of the tables of catalog/schema.sql."""
    return tuple(_TABLE.findall(sql_file("schema")))


@functools.cache
def added_columns() -> dict[str, list[tuple[str, str]]]:
    """Per table of catalog/schema.sql, the (column, type) its ALTER TABLE ... ADD COLUMN lines add
    to catalogs written before them."""
    added: dict[str, list[tuple[str, str]]] = {}
    for table, column, kind in _ADDED.findall(sql_file("schema")):
        added.setdefault(table, []).append((column, kind))
    return added


@functools.cache
def schema_columns() -> dict[str, tuple[str, ...]]:
    """Per table of catalog/schema.sql, its columns in order (those only its ALTER TABLE ... ADD
    COLUMN lines name last, as DuckDB orders them)."""
    columns = {}
    for table, body in _TABLE_BODY.findall(sql_file("schema")):
        names = [match.group(1) for line in body.splitlines()
                 if (match := _COLUMN.match(line.split("--")[0])) and match.group(1).upper() not in _CONSTRAINTS]
        names += [column for column, _ in added_columns().get(table, []) if column not in names]
        columns[table] = tuple(names)
    return columns


def _marker(table: str) -> str:
    return f"lakeloader table {table}"


def _columns_of(con: duckdb.DuckDBPyConnection, piece: str, tables: Sequence[str]) -> dict[str, set[str]] | None:
    """The columns (lower case) of each of ``tables`` of the attached catalog file, from one bind
    of attached_stored_columns over ``piece`` (attached_stored_columns_of: those stored, or
    attached_all_columns_of: every one): the marker columns split them. None when the markers do
    not come once each in order (a column of the file named like one)."""
    if not tables:
        return {}
    pieces = ", ".join(query(piece).format(marker=_marker(name), table=name) for name in tables)
    names = con.sql(query("attached_stored_columns").format(tables=pieces)).columns
    markers = {_marker(name) for name in tables}
    starts = [i for i, name in enumerate(names) if name in markers]
    if [names[i] for i in starts] != [_marker(name) for name in tables]:
        return None
    ends = starts[1:] + [len(names)]
    return {table: {name.lower() for name in names[start + 1:end]} for table, start, end in zip(tables, starts, ends)}


def _not_as_written(path: str, problem: str) -> CatalogError:
    return CatalogError(
        f"catalog {path} is not as lakeloader writes it: {problem}. It was altered by hand or by other "
        "software; rebuild the catalog (lakeloader build CONFIG into a new lake) or restore it from a trusted copy")


def _stored_columns(con: duckdb.DuckDBPyConnection, path: str) -> dict[str, set[str]]:
    """The columns the catalog file ``path`` (attached as ``lake``) stores for each table of
    catalog/schema.sql it has (generated columns are not stored); a CatalogError if any of them
    is a view there."""
    tables = catalog_tables()
    try:   # The usual case, every table there and a table: one cheap bind.
        stored = _columns_of(con, "attached_stored_columns_of", tables)
        if stored is not None:
            return stored
    except duckdb.CatalogException as exc:   # A catalog of an older schema, or altered: list what it has.
        log.debug("catalog %s: not every table of schema.sql is a table there (%s); listing its objects", path, exc)
    objects = dict(con.execute(query("attached_objects")).fetchall())
    altered = sorted(name for name in tables if objects.get(name) == "view")
    if altered:
        raise _not_as_written(path, f"{', '.join(altered)} should be tables but are views")
    stored = _columns_of(con, "attached_stored_columns_of", [name for name in tables if objects.get(name) == "table"])
    if stored is None:
        raise _not_as_written(path, "a column of its tables is named like the marker columns lakeloader reads them with")
    return stored


def _generated(path: str, columns: Iterable[tuple[str, str]]) -> CatalogError:
    named = ", ".join(f"{table}.{column}" for table, column in columns)
    return _not_as_written(path, f"{named}: generated column(s), an expression of SQL stored in the file that "
                                 "would run in every reader of it")


def _reader_tables(con: duckdb.DuckDBPyConnection, path: str, stored: dict[str, set[str]],
                   overlay: Overlay | None = None) -> str:
    """The reader's view of each table of ``stored`` (its stored columns): schema.sql's columns by
    name, so no other column of the file is read; a column schema.sql added after the catalog was
    written reads NULL (so lakes built before it still read), a table of ``_LATER_TABLES`` it
    lacks is empty, and a table of progress counters it lacks is their count from its chunk rows
    (catalog/progress.py ``counted_views``). A column of schema.sql that the file lacks, or has as
    a generated column, is a CatalogError naming it. With an ``overlay`` loaded (``_load_overlay``),
    a keyed table's rows of the chunks it replaces are its rows, and a whole table is its rows."""
    statements = []
    for name, columns in stored.items():
        missing = [column for column in schema_columns()[name] if column.lower() not in columns]
        kinds = dict(added_columns().get(name, []))
        if missing:
            every = _columns_of(con, "attached_all_columns_of", [name]) or {name: set()}
            generated = [(name, column) for column in missing if column.lower() in every[name]]
            if generated:
                raise _generated(path, generated)
            lost = [column for column in missing if column not in kinds]
            if lost:
                raise _not_as_written(path, f"table {name} lacks the column(s) {', '.join(lost)}")
        selected = [column if column not in missing else f"NULL::{kinds[column]} AS {column}"
                    for column in schema_columns()[name]]
        kind = "reader_table" if overlay is None or name in STATIC_TABLES else \
            "reader_keyed_table" if name in KEYED_TABLES else "reader_whole_table"
        statements.append(query(kind).format(table=name, columns=", ".join(selected)))
    statements += [f"CREATE TABLE {name} ({body});" for name, body in _TABLE_BODY.findall(sql_file("schema"))
                   if name in _LATER_TABLES and name not in stored]
    return "".join(statements) + counted_views(stored)


def _load_overlay(con: duckdb.DuckDBPyConnection, stored: dict[str, set[str]], overlay: Overlay, where: str) -> None:
    """Load the rows deltas add (``overlay``: the chunks they replace, and per carried table its
    rows) into the reader's in-memory database (schema ``lakeloader_delta``), each table of the
    columns the attached file stores; a CatalogIntegrityError naming ``where`` if they do not fit."""
    keys, tables = overlay
    statements = [query("delta_schema"), query("delta_keys_table")]
    for name in tables:
        columns = ", ".join(c for c in schema_columns().get(name, ()) if c.lower() in stored.get(name, ()))
        statements.append(query("delta_table").format(table=name, columns=columns))
    try:
        for name, rows in [("keys", keys), *tables.items()]:
            con.register(f"delta_rows_{name}", rows)
        try:
            con.execute(";\n".join(statements))   # one call: ~5 ms, not ~5 ms per table
        finally:
            for name in ["keys", *tables]:
                con.unregister(f"delta_rows_{name}")
        missing = set(stored) - set(tables) - set(STATIC_TABLES)
        if missing:
            raise ValueError(f"no rows of {', '.join(sorted(missing))}")
    except (duckdb.Error, ValueError) as exc:
        if is_interrupt(exc):   # Ctrl-C as DuckDB loaded them: not a fault of the lake
            raise
        raise CatalogIntegrityError(
            f"the catalog deltas {where} are not as lakeloader writes them ({' '.join(str(exc).split())}): the lake "
            "was altered; read only lakes from people you trust, and if this lake is yours `lakeloader build "
            "CONFIG` publishes a whole catalog again") from exc


def refuse_generated_columns(con: duckdb.DuckDBPyConnection) -> None:
    """On a reader's connection (``connect_reader``), a CatalogError naming the file if a table
    of schema.sql has a generated column there, one schema.sql does not name included: the
    reader's views never read those, but a user's SQL can name the file's tables (``lake.chunks``)."""
    row = con.execute(query("attached_catalog_path")).fetchone()
    if row is None:   # the build's own connection: it attached no catalog file
        return
    stored = _stored_columns(con, row[0])
    every = _columns_of(con, "attached_all_columns_of", list(stored)) or {}
    generated = [(table, column) for table, columns in every.items() for column in sorted(columns - stored[table])]
    if generated:
        raise _generated(row[0], generated)


RECOVER_CATALOG_HINT = ("recover it from the lake's newest published snapshot with `lakeloader build "
                        "CONFIG --recover-catalog` (chunks committed after that snapshot are rebuilt)")

# DuckDB reports OS errors as text only; these map it back to the errno for the advice.
_OS_REASONS = {"no space left": errno.ENOSPC, "read-only file system": errno.EROFS,
               "permission denied": errno.EACCES, "disk quota exceeded": errno.EDQUOT}


def is_damaged_catalog(path: str, exc: BaseException) -> bool:
    """Whether DuckDB's ``exc`` says the catalog file ``path`` is damaged: garbage or zeros where
    its header is, a block failing its checksum, or the file cut short (DuckDB names the file it
    could not read to the end; a chunk file cut short is not the catalog's damage)."""
    text = str(exc).lower()
    if "corrupt database file" in text or "not a valid duckdb database file" in text:
        return True
    return "could not read enough bytes from file" in text and path.lower() in text


def catalog_failure(path: str, exc: duckdb.Error, what: str = "the lake's catalog") -> LakeloaderError | None:
    """The clear error for a DuckDB error opening, reading or writing the catalog file ``path``
    (while doing ``what``): a damaged file (one line, with the ``--recover-catalog`` hint), a full
    or read-only disk, no permission; None for any other."""
    text = " ".join(str(exc).split())   # one line, whatever DuckDB's message holds
    if is_damaged_catalog(path, exc):
        return CatalogError(f"catalog {path} is corrupt ({text}): {RECOVER_CATALOG_HINT}")
    for reason, code in _OS_REASONS.items():
        if reason in text.lower():
            return write_failure(what, path, OSError(code, os.strerror(code)))
    return None


def _check_writable(path: str, found: tuple[str] | None) -> None:
    """Refuse the catalog at ``path`` whose schema version (``found``: its lake_meta row, None if
    new) this lakeloader neither writes nor upgrades."""
    if found and found[0] != SCHEMA_VERSION and found[0] not in _UPGRADED_VERSIONS:
        raise CatalogError(
            f"catalog {path} has schema version {found[0]}, this lakeloader writes "
            f"{SCHEMA_VERSION}: build into a new lake or use the matching lakeloader version")


def writer_catalog_from(source: str, target: str) -> None:
    """Make a new catalog file at ``target`` holding every row of the catalog file ``source`` (a
    published snapshot with its deltas applied, whose tables carry no keys, or an older one that
    kept them) in the tables of catalog/schema.sql with their keys, build ids going on after the
    source's: a catalog a build can write."""
    con = duckdb.connect(target)
    try:
        con.execute(query("attach_snapshot_rows"), {"path": source})
        _check_writable(source, con.execute(query("snapshot_schema_version")).fetchone())
        start = con.execute(query("snapshot_next_build_id")).fetchone()[0]
        con.execute(query("start_build_ids").format(start=int(start)))
        con.execute(sql_file("schema"))
        present = {row[0] for row in con.execute(query("snapshot_tables")).fetchall()}
        con.begin()
        for table in catalog_tables():
            if table in present:   # a catalog of an older schema lacks the tables added since
                con.execute(query("take_snapshot_rows").format(table=table))
        con.commit()
        con.execute(query("detach_snapshot_rows"))
        con.execute(query("checkpoint"))
    finally:
        con.close()


def define_views(con: duckdb.DuckDBPyConnection, analyst: bool = True) -> None:
    """Define on ``con`` what readers need (catalog/prefix.sql: committed_prefix, chunk_lines) and, with
    ``analyst``, the views and macros of catalog/views.sql built on it, for whose SQL a reader's
    catalog file is first checked to hold no generated column (``refuse_generated_columns``:
    ~3 ms, so only here)."""
    con.execute(sql_file("prefix"))
    if analyst:
        refuse_generated_columns(con)
        con.execute(sql_file("views"))


def connect_reader(path: str, analyst_views: bool = True, sql: SqlConfig | None = None,
                   overlay: Overlay | None = None, overlay_where: str = "") -> duckdb.DuckDBPyConnection:
    """A read-only connection to a catalog file that runs no SQL stored in the file and can
    reach no other file, network or extension, within the memory and threads of ``sql`` (the
    config's ``sql`` section; default: its defaults). Without ``analyst_views`` only the view readers
    need is defined (``define_views`` adds the others later: defining views is not configuration,
    so the lock below does not stop it).

    An in-memory database attaches the file read-only and reaches its tables through views; the
    views and macros of catalog/views.sql are defined from the wheel (those stored in the file are
    never used). Then external access is turned off and the configuration locked, so no statement
    on the connection or its cursors can read or write a file, ATTACH, load an extension or turn
    any of that back on.

    ``overlay`` (the rows a published version's deltas add to its base, catalog/delta.py, named
    ``overlay_where`` in errors) is loaded into the in-memory database first, and the views read
    the file's rows with it: the tables of the version, as a full snapshot of it has them.
    """
    if not os.path.exists(path):
        raise CatalogError(f"no catalog at {path}: build the lake first (lakeloader build CONFIG)")
    limits = sql or SqlConfig()
    con = duckdb.connect(":memory:", config={**_READER_CONFIG, "memory_limit": f"{limits.memory_limit}B",
                                             "threads": limits.threads or min(4, os.cpu_count() or 1)})
    try:
        try:
            con.execute(query("attach_catalog"), {"path": path})
        except duckdb.Error as exc:
            if is_lock_error(exc):
                raise _locked_error(path, exc) from exc
            if isinstance(exc, duckdb.ResourceInUseException):
                raise CatalogLockedError(
                    f"catalog {path} is held by a build in this process: readers here read its "
                    "published snapshot, or its live catalog when given the build's LiveCatalog "
                    "handle") from exc
            raise catalog_failure(path, exc) or exc
        stored = _stored_columns(con, path)
        if overlay is not None:
            _load_overlay(con, stored, overlay, overlay_where)
        con.execute(_reader_tables(con, path, stored, overlay))
        define_views(con, analyst=analyst_views)
        try:
            con.execute(query("hide_progress_bar"))
        except duckdb.InvalidInputException as exc:   # Jupyter without ipywidgets: no bar is drawn
            log.debug("DuckDB's progress bar setting left as it is: %s", exc)
        con.execute(query("lock_reader"))
    except BaseException:
        con.close()
        raise
    return con


def _starts(counts: list[int]) -> list[int]:
    """Where each of consecutive runs of ``counts`` items starts."""
    return list(itertools.accumulate(counts, initial=0))[:-1]


def _column_sums(rows: list[list[int]]) -> list[int]:
    """Element-wise sums of equal-length lists (per-kind counts over row groups)."""
    return [sum(column) for column in zip(*rows)]


def _columns(rows: Iterable[dict[str, Any]], names: Sequence[str]) -> dict[str, list[Any]]:
    """``rows`` as one list per name (the list parameters of the commit_batch_* statements)."""
    columns: dict[str, list[Any]] = {name: [] for name in names}
    for row in rows:
        for name in names:
            columns[name].append(row[name])
    return columns


def _chunk_columns(results: Sequence[ChunkResult]) -> dict[str, list[Any]]:
    """The chunks' values of commit_batch_chunks: one per chunk."""
    return {
        "dataset": [r.dataset for r in results], "global_index": [r.global_index for r in results],
        "num_docs": [r.num_docs for r in results], "num_tokens": [r.num_tokens for r in results],
        "num_records": [r.num_records for r in results], "num_bytes": [r.num_bytes for r in results],
        "checksum": [r.checksum for r in results], "num_rejects": [len(r.rejects) for r in results],
        "source_bytes": [r.source_bytes for r in results], "worker": [r.worker for r in results],
        "seconds": [float(r.seconds) for r in results],
        "num_parts": [_column_sums(r.row_group_parts) for r in results],
        "part_tokens": [_column_sums(r.row_group_part_tokens) for r in results],
        "media_bytes": [r.media_bytes for r in results], "media_checksum": [r.media_checksum for r in results],
    }


def _image_columns(results: Sequence[ChunkResult]) -> dict[str, list[Any]]:
    """The image occurrences of commit_batch_images: one per image of each chunk's documents."""
    return _columns(({"dataset": r.dataset, "global_index": r.global_index, **dict(zip(IMAGE_ROW_FIELDS, row))}
                     for r in results for row in r.images), ("dataset", "global_index", *IMAGE_ROW_FIELDS))


def _row_group_columns(results: Sequence[ChunkResult]) -> dict[str, list[Any]]:
    """The row groups of commit_batch_row_groups: one per row group of each chunk."""
    columns: dict[str, list[Any]] = {name: [] for name in (
        "dataset", "global_index", "row_group", "first_doc", "num_docs", "first_token", "num_tokens",
        "num_parts", "part_tokens")}
    for r in results:
        groups = len(r.row_group_docs)
        columns["dataset"] += [r.dataset] * groups
        columns["global_index"] += [r.global_index] * groups
        columns["row_group"] += range(groups)
        columns["first_doc"] += _starts(r.row_group_docs)
        columns["num_docs"] += r.row_group_docs
        columns["first_token"] += _starts(r.row_group_tokens)
        columns["num_tokens"] += r.row_group_tokens
        columns["num_parts"] += r.row_group_parts
        columns["part_tokens"] += r.row_group_part_tokens
    return columns


_PLAN_COLUMNS = ("dataset", "global_index", "plan_key", "num_examples", "num_tokens", "truncated_docs",
                 "dropped_tokens", "split_docs")


def _example_columns(results: Sequence[ChunkResult]) -> dict[str, list[Any]]:
    """The packing counts of commit_batch_examples: one per plan of each chunk."""
    return _columns(({"dataset": r.dataset, "global_index": r.global_index, **dataclasses.asdict(p)}
                     for r in results for p in r.plans), _PLAN_COLUMNS)


def _selection_columns(results: Sequence[ChunkResult]) -> dict[str, list[Any]]:
    """The selections of commit_batch_selections: one per row group of each chunk's file."""
    return _columns(({"dataset": r.dataset, "global_index": r.global_index, "row_group": group,
                      "source_first_doc": int(first), "docs": [int(d) for d in docs]}
                     for r in results for group, (first, docs) in enumerate(r.selection or ())),
                    ("dataset", "global_index", "row_group", "source_first_doc", "docs"))


def _reject_columns(results: Sequence[ChunkResult], splits: dict[tuple[str, int], tuple[int, int]]
                    ) -> dict[str, list[Any]]:
    """The rejects of commit_batch_rejects, in order; ``splits``: each chunk's shard and split."""
    return _columns(({"dataset": r.dataset, "global_index": r.global_index, "location": reject.location,
                      "line": reject.line, "reason": reject.reason,
                      "shard_index": splits[(r.dataset, r.global_index)][0],
                      "split_index": splits[(r.dataset, r.global_index)][1]}
                     for r in results for reject in r.rejects),
                    ("dataset", "global_index", "location", "line", "reason", "shard_index", "split_index"))


@dataclasses.dataclass(frozen=True)
class IndexFile:
    """A documents index file written into the lake: its lake-relative path, dataset, the global
    indices of the chunks whose rows it holds, and its documents, size and sha256."""

    path: str
    dataset: str
    chunks: list[int]
    num_docs: int
    num_bytes: int
    checksum: str

    def record(self) -> dict[str, Any]:
        """Its row of ``document_index_files`` (insert_document_index_file)."""
        return {"path": self.path, "dataset": self.dataset, "first_chunk": min(self.chunks),
                "last_chunk": max(self.chunks), "num_chunks": len(self.chunks), "num_docs": self.num_docs,
                "num_bytes": self.num_bytes, "checksum": self.checksum}


@dataclasses.dataclass(frozen=True)
class MediaFile:
    """A chunk's media file rewritten without the images a lower chunk holds: its lake-relative
    path, its chunk, the images it holds, its size and sha256 (a row of ``media_files``)."""

    dataset: str
    global_index: int
    path: str
    num_images: int
    num_bytes: int
    checksum: str


class CatalogWriter:
    """The single read-write connection of a build; every write happens in one transaction."""

    def __init__(self, path: str, live: LiveCatalog | None = None) -> None:
        """Open (creating if needed) the catalog at ``path`` for writing; ``live``, if given,
        follows it until :meth:`close` (readers in this process then read it live)."""
        self.path = path
        self._live = live
        self.changes = ChangeLog()   # what the next publish must carry (catalog/changes.py)
        self._checkpoint_failed = False   # DuckDB then refuses every further write, a checkpoint too
        existed = os.path.exists(path)
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.con = duckdb.connect(path)
        except OSError as exc:
            raise write_failure("the lake's catalog", path, exc) from exc
        except duckdb.Error as exc:
            if is_lock_error(exc):
                raise _locked_error(path, exc) from exc
            self._discard(existed)
            raise catalog_failure(path, exc) or exc
        try:
            self._apply_schema()
        except BaseException as exc:
            self.con.close()
            self._discard(existed)
            if isinstance(exc, duckdb.Error):
                raise catalog_failure(path, exc) or exc
            raise
        # Readers in this process (LiveCatalog) take their cursors from this one, never from
        # self.con: a connection used by two threads at once refuses the second call, and the
        # build's own statements must not be the ones refused.
        self.reader_source = self.con.cursor()
        if live is not None:
            live.attach(self)

    def _discard(self, existed: bool) -> None:
        """Remove a catalog file this writer created but could not set up (a full disk, say)."""
        if not existed:
            for leftover in (self.path, f"{self.path}.wal"):
                remove_quietly(leftover)

    def _apply_schema(self) -> None:
        self._run("writer_settings")
        self.con.execute(sql_file("schema"))
        _check_writable(self.path, self._run("schema_version").fetchone())
        self._run("set_schema_version", {"version": SCHEMA_VERSION})
        self._run("init_lake_id", {"lake_id": uuid.uuid4().hex})
        define_views(self.con)
        self._check_progress()

    def _check_progress(self) -> None:
        """Count the progress counters afresh where they differ from the chunk rows: a catalog
        written before them, or one whose chunk rows were changed by other SQL than the writer's."""
        if self._run_counting("progress_differs").fetchone()[0]:
            log.info("catalog %s: counting its progress counters from its chunk rows", self.path)
            self.recount_progress()

    def recount_progress(self, datasets: Sequence[str] | None = None) -> None:
        """Count the progress counters of ``datasets`` (None: every dataset) afresh from their
        chunk rows, in one transaction: for code changing chunk rows by SQL of its own (the
        demo's grown lakes, benchmarks), which the writer's own writes never need."""
        with self.transaction():
            self._recount(datasets)

    def _recount(self, datasets: Sequence[str] | None) -> None:
        self._run_counting("recount_progress", {"datasets": None if datasets is None else list(datasets)})

    def close(self) -> None:
        """Checkpoint and close the connection (closed even when the checkpoint fails)."""
        if self._live is not None:
            self._live.detach()
        try:
            if not self._checkpoint_failed:
                self.checkpoint()
        finally:
            self._close_connection()

    def checkpoint(self) -> None:
        """Write everything committed so far from the write-ahead log into the catalog file (a
        full or read-only disk is a clear error). After a failed checkpoint DuckDB takes no more
        writes on this connection; the write-ahead log keeps every commit for the next open."""
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        while True:
            try:
                self._run("checkpoint")
                return
            except duckdb.TransactionException as exc:
                # A reader's query on a cursor of the live catalog (registering its views) is a
                # write transaction of its own; such a query ends: wait for it.
                if "other write transactions" not in str(exc) or time.monotonic() > deadline:
                    self._checkpoint_failed = True
                    raise catalog_failure(self.path, exc) or exc
                time.sleep(0.02)
            except duckdb.Error as exc:
                self._checkpoint_failed = True
                raise catalog_failure(self.path, exc) or exc

    def _close_connection(self) -> None:
        # DuckDB refuses to close a connection while a cursor of it is in a call: one a user took
        # with LiveCatalog.cursor (Lake.connect(live=...)), say. Such a call ends: wait for it.
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        while True:
            try:
                self.con.close()
                return
            except duckdb.ResourceInUseException as exc:
                if time.monotonic() > deadline:
                    raise CatalogError(
                        f"could not close the catalog {self.path} at the end of the build: a query on "
                        "a cursor of its live catalog (LiveCatalog.cursor, Lake.connect(live=...)) was "
                        f"still running after {CLOSE_WAIT_SECONDS:g}s. Everything built is committed, but the "
                        "file stays locked until that query ends: end it (or its process) before the "
                        "next build of this lake") from exc
                time.sleep(0.01)

    def __enter__(self) -> CatalogWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if kind is None:
            self.close()
            return
        try:
            self.close()
        except Exception as exc:  # keep the error that ended the build the one the user sees
            log.warning("could not checkpoint the catalog %s after the build failed: %s", self.path, exc)

    @contextlib.contextmanager
    def transaction(self, **frames: pd.DataFrame) -> Iterator[None]:
        """Run the block as one transaction: committed when it ends, rolled back when it (or the
        commit) raises, and the error re-raised; no reader ever sees half of it. Each of
        ``frames`` is readable by SQL as a view of its name inside the transaction."""
        self._run("begin_transaction")
        try:
            try:
                for name, frame in frames.items():
                    self.con.register(name, frame)
                yield
                self._run("commit_transaction")
            except BaseException:
                try:
                    self._run("rollback_transaction")
                except duckdb.TransactionException:
                    pass   # DuckDB ended it already (an interrupted statement aborts its transaction)
                raise
        finally:
            for name in frames:
                self.con.unregister(name)

    def _run(self, name: str, params: dict[str, Any] | None = None) -> duckdb.DuckDBPyConnection:
        return self._execute(name, query(name), params)

    def _run_counting(self, name: str, params: dict[str, Any] | None = None) -> duckdb.DuckDBPyConnection:
        """Run statement ``name`` whose placeholders are the progress counters' count from the
        chunk rows (:func:`~lakeloader.catalog.progress.counted`)."""
        return self._execute(name, query(name).format(**counted()), params)

    def _execute(self, name: str, text: str, params: dict[str, Any] | None) -> duckdb.DuckDBPyConnection:
        self.changes.statement(name)
        statements = [s for s in text.split(";") if s.strip()]
        result = self.con
        for statement in statements:
            result = self.con.execute(statement, params) if params else self.con.execute(statement)
        return result

    def built_plan(self, name: str) -> BuiltPlan | None:
        """The plan in force of dataset ``name`` as the catalog holds it (None: none), for
        :func:`~lakeloader.plan.growth.grown_plan`."""
        row = self._run("reader_dataset", {"name": name}).fetchone()
        if row is None:
            return None
        chunk_dir = self._run("chunk_folders", {"datasets": [name]}).fetchone()[0]
        files = [(url_from_bytes(raw), int(size), str(version))
                 for raw, size, version in self._run("built_plan_files", {"name": name}).fetchall()]
        return BuiltPlan(str(row[0]), str(chunk_dir), row[3] is not None, files,
                         self._run("built_plan_chunks", {"name": name}).df())

    def register_plan(self, plan: DatasetPlan, *, tokenizer_path: str, token_type: str,
                      vocab_size: int, split_size: int, on_error: str, definition: str | None = None,
                      config_file: str | None = None) -> bool:
        """Store ``plan`` unless the same fingerprint is already planned; returns whether it was new.
        ``definition`` (a dataset built from sources: its config's
        :func:`~lakeloader.plan.planner.definition_fingerprint`) is recorded as planned as ``plan``
        by ``config_file``, in the same transaction as the plan.

        A dataset whose fingerprint changed gets the new plan; its committed chunks that the new
        plan names for the same split of the same unchanged file (same chunk path) stay committed
        under their new global index, with their row groups and rejects, so they are not
        tokenized again. Its other chunks and rejects are forgotten (their files are never read
        again). Sources are stored readable in ``source`` and exactly in ``source_raw``. A dataset
        defined by a filter (``plan.source``) keeps nothing of an older plan: a changed predicate
        or source is a new selection, evaluated afresh.
        """
        current = self._run("dataset_plan", {"name": plan.name}).fetchone()
        recorded = {"name": plan.name, "definition": definition, "fingerprint": plan.fingerprint,
                    "config": config_file}
        if current and current[0] == plan.fingerprint:
            with self.transaction():
                self._run("set_on_error", {"name": plan.name, "on_error": on_error})
                if definition is not None:
                    self._run("record_definition", recorded)
            return False
        if current:
            replaced = replaced_definitions(self.con, plan.name, current[0], definition, config_file)
            if replaced:
                log.warning("dataset %r: replacing the lake's plan %s, built from %s, with the definition of %s "
                            "(one plan per name): loaders of %s refuse the dataset until that config is built again; "
                            "give one of the definitions another name to keep both",
                            plan.name, current[0][:12], replaced, config_file or "this config", replaced)
        chunk_rows = plan.chunks.assign(dataset=plan.name)
        splits = plan.chunks.groupby("shard_index").size()
        shard_rows = pd.DataFrame({
            "dataset": plan.name,
            "shard_index": range(len(plan.shards)),
            "source": [readable_url(s.url) for s in plan.shards],
            "layout": [s.layout for s in plan.shards],
            "compression": [s.compression for s in plan.shards],
            "size_bytes": [s.size for s in plan.shards],
            "version": [s.version for s in plan.shards],
            "num_splits": [int(splits.get(i, 0)) for i in range(len(plan.shards))],
            "source_raw": [url_bytes(s.url) for s in plan.shards],
        })
        filtered = plan.source is not None
        with self.transaction(new_chunks=chunk_rows, new_shards=shard_rows):
            if not filtered:
                self._run("keep_adoptable_chunks", {"name": plan.name})
            self._run("forget_dataset", {"name": plan.name})
            self._run("insert_dataset_plan", {
                "name": plan.name, "fingerprint": plan.fingerprint, "format": plan.format,
                "fields": list(plan.fields), "chunk_dir": plan.chunk_dir,
                "tokenizer_path": tokenizer_path, "token_type": token_type,
                "vocab_size": vocab_size, "split_size": split_size, "on_error": on_error,
                "encoder": plan.encoder, "source_dataset": plan.source, "selection": plan.where,
            })
            self._run("insert_shard_plans")
            self._run("insert_chunk_plans")
            adopted = 0
            if not filtered:
                adopted = self._run("adopt_chunks", {"name": plan.name}).fetchone()[0]
                self._run("drop_adopted_chunks")
            if definition is not None:
                self._run("record_definition", recorded)
            if plan.extends is not None:
                self._run("insert_plan_growth", {"name": plan.name, "fingerprint": plan.fingerprint,
                                                 "extends": plan.extends[0], "chunks_before": plan.extends[1]})
            for missing in plan.missing:
                self._run("insert_reject", {
                    "dataset": plan.name, "source": missing.source, "location": "whole file",
                    "line": None, "reason": missing.reason, "shard_index": None,
                    "split_index": None, "global_index": None, "build_id": None,
                })
            self._recount([plan.name])
        if adopted:
            log.info("dataset %r: re-planned; %d committed chunk(s) of unchanged files kept", plan.name, adopted)
        return True

    def register_packing(self, dataset: str, spec: PackingSpec) -> None:
        """Record that per-chunk counts of ``spec`` are kept for ``dataset``."""
        self._run("insert_packing_plan", {"plan_key": spec.plan_key, "dataset": dataset,
                                          "seq_len": spec.seq_len, "mode": spec.mode, "spec": spec.to_json()})

    def _insert_plan_stats(self, dataset: str, global_index: int, plans: Iterable[PlanStats]) -> None:
        self.changes.chunks([(dataset, global_index)])
        for stats in plans:
            self._run("insert_chunk_examples", {"dataset": dataset, "global_index": global_index,
                                                **dataclasses.asdict(stats)})

    def commit_plans(self, dataset: str, rows: Iterable[tuple[int, PlanStats]]) -> None:
        """Store packing counts computed for already committed chunks, in one transaction."""
        with self.transaction():
            for global_index, stats in rows:
                self._insert_plan_stats(dataset, global_index, [stats])

    def chunks_without_plan(self, dataset: str, plan_key: str) -> pd.DataFrame:
        """Committed chunks of ``dataset`` whose counts under ``plan_key`` are missing."""
        return self._run("chunks_without_plan", {"name": dataset, "plan_key": plan_key}).df()

    def register_mixture(self, spec: MixtureSpec) -> bool:
        """Store ``spec``'s schedule (stages, quantised weights, Huffman trees: the rows of
        :func:`lakeloader.index.mixture.mixture_rows`) under its ``mixture_id`` unless it is there
        already; returns whether it was new. Registering it again only updates
        ``last_registered_at``."""
        rows = mixture_rows(spec)
        with self.transaction():
            known = self._run("touch_mixture", {"mixture_id": spec.mixture_id}).fetchone()
            if not known:
                self._run("insert_mixture", rows.mixture)
                for stage in rows.stages:
                    self._run("insert_mixture_stage", stage)
                for node in rows.nodes:
                    self._run("insert_mixture_node", node)
        return not known

    def chunk_folders(self, datasets: Sequence[str]) -> list[str]:
        """Lake-relative folders of the chunk files of ``datasets``."""
        rows = self._run("chunk_folders", {"datasets": list(datasets)}).fetchall()
        return [row[0] for row in rows]

    def chunk_count(self, datasets: Sequence[str]) -> int:
        """Planned chunks of ``datasets``."""
        return int(self._run("chunk_count", {"datasets": list(datasets)}).fetchone()[0])

    def datasets_without_documents(self, datasets: Sequence[str]) -> pd.DataFrame:
        """Completely built ``datasets`` that hold no document: name, num_rejects, sources (the
        first five) and num_sources."""
        return self._run("datasets_without_documents", {"datasets": list(datasets)}).df()

    def filtered_datasets(self, datasets: Sequence[str]) -> pd.DataFrame:
        """Those of ``datasets`` defined by a filter: name, source_dataset, where."""
        return self._run("filtered_datasets", {"datasets": list(datasets)}).df()

    def pending_selections(self, datasets: Sequence[str], committed: bool = False,
                           built: Sequence[tuple[str, int]] | None = None) -> pd.DataFrame:
        """Chunks of the filtered ``datasets`` whose source chunk is committed, not committed
        themselves (or, with ``committed``, committed ones), by global index: dataset,
        source_dataset, where, global_index and the source chunk's path, num_bytes, checksum and
        num_records; with ``built`` (``(dataset, global_index)`` of source chunks just committed),
        only those of the shards of ``built``: what their commit made ready."""
        keys = None if built is None else [{"dataset": d, "global_index": i} for d, i in built]
        return self._run("pending_selections", {"datasets": list(datasets), "committed": committed,
                                                "built": keys}).df()

    def pending_chunks(self, datasets: Sequence[str], after: tuple[int, int] = (-1, 0),
                       rows: int | None = None) -> pd.DataFrame:
        """Uncommitted chunks of ``datasets``, by global index (datasets interleaved in their order):
        the first ``rows`` (None: all) after ``after``, a global index and the position of its
        dataset in ``datasets`` counted from 1 (``(-1, 0)``: from the first)."""
        return self._run("chunk_tasks", {"datasets": list(datasets), "committed": False, "after_index": after[0],
                                         "after_position": after[1], "rows": rows}).df()

    def pending_chunk_count(self, datasets: Sequence[str]) -> int:
        """How many chunks of ``datasets`` are not committed."""
        return int(self._run("pending_chunk_count", {"datasets": list(datasets)}).fetchone()[0])

    def committed_chunks(self, datasets: Sequence[str]) -> pd.DataFrame:
        """Committed chunks of ``datasets`` with their task columns (those of :meth:`pending_chunks`)
        and their recorded ``num_bytes`` and ``checksum``."""
        return self._run("chunk_tasks", {"datasets": list(datasets), "committed": True, "after_index": -1,
                                         "after_position": 0, "rows": None}).df()

    def committed_among(self, dataset: str, global_indices: Sequence[int]) -> set[int]:
        """Those of chunks ``global_indices`` of ``dataset`` committed already."""
        rows = self._run("committed_among", {"name": dataset, "global_index": list(global_indices)}).fetchall()
        return {int(row[0]) for row in rows}

    def index_files(self, dataset: str) -> pd.DataFrame:
        """The documents index files of ``dataset``: path, num_chunks, num_docs, first_chunk,
        checksum, num_bytes."""
        return self._run("document_index_files_of_dataset", {"name": dataset}).df()

    def index_file_chunks(self, paths: Sequence[str]) -> list[int]:
        """The chunks whose rows index files ``paths`` hold."""
        return [int(row[0]) for row in self._run("document_index_chunks_of", {"paths": list(paths)}).fetchall()]

    def replace_index_files(self, old: Sequence[str], new: IndexFile) -> None:
        """Record that index file ``new`` holds the rows of index files ``old`` (one transaction;
        the old files stay in the lake for readers of older snapshots)."""
        with self.transaction():
            self.changes.chunks(self._run("document_index_chunk_keys", {"paths": list(old)}).fetchall())
            self._run("insert_document_index_file", new.record())
            self._run("move_document_index_chunks", {"path": new.path, "paths": list(old)})
            self._run("drop_document_index_files", {"paths": list(old)})

    def forget_index_files(self, paths: Sequence[str]) -> None:
        """Forget index files ``paths`` (one transaction): their chunks are read from their files."""
        with self.transaction():
            self.changes.chunks(self._run("document_index_chunk_keys", {"paths": list(paths)}).fetchall())
            self._run("forget_document_index_chunks", {"paths": list(paths)})
            self._run("drop_document_index_files", {"paths": list(paths)})

    def media_rewrites(self, dataset: str) -> pd.DataFrame:
        """The committed chunks of ``dataset`` whose own media file holds images a lower chunk holds
        too, in global order: global_index, path, media_bytes, media_checksum, ``keep`` (the ids
        of the images they are the lowest chunk of) and ``dropped`` (the others, each an
        ``image_id`` and the ``owner``: the lowest chunk holding it)."""
        return self._run("media_rewrites", {"name": dataset}).df()

    def current_media_files(self, dataset: str) -> dict[int, str]:
        """Per committed chunk of ``dataset`` storing images: the media file it reads them from
        (the one a build's end rewrote, else its own)."""
        rows = self._run("current_media_files", {"name": dataset}).fetchall()
        return {int(index): deduped or media_path(path) for index, path, deduped in rows}

    def record_media_files(self, files: Sequence[MediaFile]) -> None:
        """Record the rewritten media files ``files`` (one transaction; the files they replace stay
        in the lake for readers of older snapshots)."""
        for dataset in sorted({file.dataset for file in files}):
            mine = [file for file in files if file.dataset == dataset]
            self.changes.chunks((dataset, file.global_index) for file in mine)
            with self.transaction():
                self._run("insert_media_files", {
                    "dataset": dataset, "global_index": [f.global_index for f in mine], "path": [f.path for f in mine],
                    "num_images": [f.num_images for f in mine], "num_bytes": [f.num_bytes for f in mine],
                    "checksum": [f.checksum for f in mine]})

    def forget_media_files(self, dataset: str, global_indices: Sequence[int]) -> None:
        """Forget the rewritten media files of chunks ``global_indices`` of ``dataset``: they read
        their own media files again (until the next build's end rewrites them)."""
        self.changes.chunks((dataset, index) for index in global_indices)
        with self.transaction():
            self._run("forget_media_files", {"dataset": dataset, "global_index": [int(i) for i in global_indices]})

    def commit(self, results: Sequence[ChunkResult], build_id: int, index_files: Sequence[IndexFile] = ()) -> int:
        """Commit finished chunks with their row groups, images, packing counts, selections, rejects
        and ``index_files`` (the documents index rows of chunks not committed before) in one
        transaction, by a few statements for the whole batch whatever its size. A chunk
        committed already (a retried task finishing twice, a repaired chunk: same bytes), or
        again later in the batch, only gets the packing counts it lacks. Returns the number of
        chunks newly committed."""
        if not results:
            return 0
        first: dict[tuple[str, int], ChunkResult] = {}
        for r in results:
            first.setdefault((r.dataset, r.global_index), r)
        chunks = list(first.values())
        indexes = [r.global_index for r in chunks]
        self.changes.chunks(first)
        with self.transaction():
            columns = _chunk_columns(chunks)
            if len(chunks) == 1:
                one = {name: values[0] for name, values in columns.items()}
                rows = self._run("commit_chunk", {**one, "build_id": build_id}).fetchall()
            else:
                rows = self._run("commit_batch_chunks", {
                    **columns, "lo": min(indexes), "hi": max(indexes), "build_id": build_id}).fetchall()
            splits = {(dataset, index): (shard, split) for dataset, index, shard, split in rows}
            fresh = [r for r in chunks if (r.dataset, r.global_index) in splits]
            committed = {id(r) for r in fresh}
            others = [r for r in results if id(r) not in committed]
            if any(r.row_group_docs for r in fresh):
                self._run("commit_batch_row_groups", _row_group_columns(fresh))
            if any(r.images for r in fresh):
                self._run("commit_batch_images", _image_columns(fresh))
            if any(r.plans for r in fresh):
                self._run("commit_batch_examples", _example_columns(fresh))
            if any(r.plans for r in others):
                self._run("commit_batch_missing_examples", _example_columns(others))
            if any(r.selection for r in fresh):
                self._run("commit_batch_selections", _selection_columns(fresh))
            if any(r.rejects for r in fresh):
                self._run("commit_batch_rejects", {**_reject_columns(fresh, splits), "build_id": build_id})
            if fresh:
                self._count_commits(fresh, splits)
            for file in index_files:
                self.changes.chunks((file.dataset, index) for index in file.chunks)
                self._run("insert_document_index_file", file.record())
                self._run("insert_document_index_chunks",
                          {"dataset": file.dataset, "global_index": file.chunks, "path": file.path})
        return len(fresh)

    def _count_commits(self, fresh: Sequence[ChunkResult], splits: dict[tuple[str, int], tuple[int, int]]) -> None:
        """Add chunks ``fresh``, just committed, to the progress counters, and move the committed
        prefix of each dataset whose prefix ended at one of them to the next uncommitted chunk."""
        per_dataset, per_shard = commit_sums(fresh, splits)
        if len(per_shard["dataset"]) == 1:
            one = {name: values[0] for name, values in per_shard.items()}
            shards = self._run("count_committed_shard", one).fetchall()
        else:
            shards = self._run("count_committed_shards", per_shard).fetchall()
        self.changes.chunks((dataset, key) for dataset, key, _ in shards)
        completed = collections.Counter(dataset for dataset, _, complete in shards if complete)
        for sums in per_dataset:
            dataset, window = sums["dataset"], progress.PREFIX_WINDOW
            prefix, planned = self._run("count_committed_dataset", {
                **sums, "shards_done": completed[dataset], "window": window}).fetchone()
            if prefix == sums["first"] + window < planned:   # no uncommitted chunk in the window
                end = self._prefix_end(dataset, prefix, planned)
                self._run("set_committed_prefix", {"name": dataset, "prefix": end})

    def _prefix_end(self, dataset: str, start: int, planned: int) -> int:
        """The lowest global index from ``start`` on of an uncommitted chunk of ``dataset`` (of
        ``planned`` chunks), or ``planned``: windows of rows from ``start`` on, growing."""
        window = progress.PREFIX_WINDOW
        while start < planned:
            window_rows = {"name": dataset, "lo": start, "hi": start + window - 1}
            found = self._run("next_uncommitted", window_rows).fetchone()[0]
            if found is not None:
                return int(found)
            start, window = start + window, window * 2
        return planned

    def start_build(self, *, workers: int, scheduler: str, dashboard: str, version: str, encoder: str = "") -> int:
        """Record a new build run (marking runs left 'running' by a crash as interrupted);
        ``encoder``: what encodes its documents, with its version."""
        self._run("interrupt_stale_builds")
        row = self._run("start_build", {
            "workers": workers, "scheduler": scheduler, "dashboard": dashboard,
            "host": socket.gethostname(), "pid": os.getpid(), "version": version,
            "encoder": encoder or None,
        }).fetchone()
        return int(row[0])

    def set_build_cluster(self, build_id: int, *, workers: int, dashboard: str) -> None:
        """Record the Dask cluster a build runs on once it is up."""
        self._run("set_build_cluster", {"build_id": build_id, "workers": workers, "dashboard": dashboard})

    def finish_build(self, build_id: int, **stats: Any) -> None:
        """Record the end of a build run with its totals."""
        self._run("finish_build", {"build_id": build_id, **stats})
