"""Published read-only versions of the catalog in the lake, for readers in other processes/hosts.

Layout: a version is a base, a full snapshot (``<lake>/_catalog/catalog-<version>.duckdb`` and its
reader index ``catalog-<version>.<table>.arrow``, catalog/reader_index.py), plus the deltas of the
versions after it (``catalog-<version>.delta.arrow``, catalog/delta.py: what changed since the
previous version); ``<lake>/_catalog/CURRENT`` is a small JSON pointer replaced atomically after
the files it names are complete. The pointer gives each of those files' sha256 and is sealed by a
checksum of its own (catalog/pointer.py): a reader opens only files whose bytes are those
published, and sees the version as a full snapshot of it would show it.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import duckdb
import pyarrow as pa

from lakeloader.catalog.changes import ChangeLog
from lakeloader.catalog.delta import Delta, Merged, apply_deltas, merge, read_delta, write_delta
from lakeloader.catalog.hash_records import HashRecords
from lakeloader.catalog.location import LakeLocation
from lakeloader.catalog.pointer import (
    CATALOG_FILE,
    MAX_DELTAS,
    POINTER,
    base_version,
    delta_file,
    delta_key,
    delta_versions,
    parse_pointer,
    seal_pointer,
    snapshot_file,
    snapshot_prefix,
)
from lakeloader.catalog.reader_index import ATTACHED, INDEX_FORMAT, TABLES, ReaderIndex, index_file, write_reader_index
from lakeloader.catalog.sql import query
from lakeloader.catalog.store import catalog_failure, catalog_tables, connect_reader, is_interrupt, writer_catalog_from
from lakeloader.config import SqlConfig
from lakeloader.contracts.errors import CatalogError, CatalogIntegrityError, CatalogNotPublishedError
from lakeloader.storage import is_transient, remove_quietly, sha256_of, write_atomically, write_failure

log = logging.getLogger(__name__)

SNAPSHOT_DIR = "_catalog"
KEEP_SNAPSHOTS = 3
SNAPSHOT_BLOCK_SIZE = 16384
_PUBLISHED = re.compile(r"catalog-(\d+)\.(?:duckdb|\w+\.arrow)")   # a whole file (not a download's .tmp-)
MAX_WRITER_DELTAS = 16   # a base gets a new one after this many deltas ...
DELTA_SHARE = 0.25       # ... or once its deltas hold this share of its bytes
# DuckDB's memory for copying a snapshot, beyond what the writer's catalog holds: the copy spills
# the rest (at a million chunks the driver's peak fell from 1.7 to 1.2-1.4 GB, the copy as fast).
COPY_MEMORY = 512 * 2**20
T = TypeVar("T")


def read_pointer(lake: LakeLocation, sealed: bool = True) -> dict[str, Any] | None:
    """The CURRENT pointer of the lake's published catalog, checked (``parse_pointer``; a build
    passes ``sealed=False`` to take one published before checksums), or None if nothing is
    published."""
    try:
        data = lake.fs.cat_file(lake.path_of(POINTER))
    except FileNotFoundError:
        return None
    return parse_pointer(data, lake.url_of(POINTER), TABLES, INDEX_FORMAT, sealed)


def _sha256_file(path: str) -> str:
    with open(path, "rb") as handle:
        return sha256_of(handle)


def _copy_catalog(con: duckdb.DuckDBPyConnection, target: str, index_target: Callable[[str], str]) -> None:
    """Copy the rows of every table of the writer's open catalog into a new DuckDB file, in one
    transaction, through the writer's own connection, and write the copy's reader index (each
    table to ``index_target(table)``). The copy's tables carry no keys (a snapshot is only read; a
    build adopting one takes its rows into a keyed catalog: ``writer_catalog_from``). DuckDB copies
    within COPY_MEMORY more than the catalog holds, or, where that is too little, without a limit.

    The catalog file must not be opened any other way in the writer's process: DuckDB guards it
    with a POSIX record lock, which the process loses as soon as it closes *any* descriptor of the
    file, so a plain file copy would silently let a second build open the catalog for writing.
    """
    try:
        _copy_within(con, target, index_target, COPY_MEMORY)
    except duckdb.OutOfMemoryException as exc:
        log.info("copying the catalog snapshot within %d MB more than the catalog holds ran out of memory (%s): "
                 "copying it again without that limit", COPY_MEMORY // 2**20, " ".join(str(exc).split()))
        for leftover in (target, f"{target}.wal", *(index_target(table) for table in TABLES)):
            remove_quietly(leftover)
        _copy_within(con, target, index_target, None)


def _copy_within(con: duckdb.DuckDBPyConnection, target: str, index_target: Callable[[str], str],
                 memory: int | None) -> None:
    """:func:`_copy_catalog` with DuckDB's memory limited to ``memory`` bytes more than the
    catalog holds (None: not limited)."""
    # The smallest block size: with the default 256 KiB blocks every table takes whole blocks,
    # so even an empty catalog's copy was about 5 MB.
    con.execute(f"ATTACH ? AS {ATTACHED} (BLOCK_SIZE {SNAPSHOT_BLOCK_SIZE})", [target])
    copying = False
    try:
        if memory is not None:
            held = int(con.execute(query("memory_held")).fetchone()[0] or 0)
            con.execute(query("limit_memory").format(limit=held + memory))
        con.begin()
        copying = True
        for table in catalog_tables():
            con.execute(query("copy_table").format(name=ATTACHED, table=table))
        con.commit()
        copying = False
        write_reader_index(con, index_target)
    except BaseException:
        # The copy's own error (an interrupt, a full disk, memory) is the one raised.
        for step, undo in (("roll back", con.rollback if copying else None),
                           ("detach", lambda: con.execute(f"DETACH {ATTACHED}")),
                           ("lift the memory limit of", lambda: con.execute(query("unlimit_memory")))):
            try:
                if undo is not None:
                    undo()
            except duckdb.Error as err:
                log.debug("could not %s the snapshot copy after it failed: %s", step, err)
        raise
    con.execute(query("unlimit_memory"))
    con.execute(f"DETACH {ATTACHED}")


def catalog_identity(con: duckdb.DuckDBPyConnection) -> tuple[str | None, int]:
    """The lake id a catalog belongs to (None for catalogs from before lake ids) and the newest
    snapshot version it was published as (0 if never)."""
    def value(key: str) -> str | None:
        row = con.execute(query("lake_meta_value"), {"key": key}).fetchone()
        return row[0] if row else None

    return value("lake_id"), int(value("published_version") or 0)


def publish_snapshot(con: duckdb.DuckDBPyConnection, lake: LakeLocation, build_id: int | None,
                     changes: ChangeLog | None = None, whole: bool = False) -> int:
    """Publish the writer's catalog as the lake's next snapshot version: a delta of the chunks
    ``changes`` recorded since this writer's previous publish where that is the lake's current
    version and its base has few enough deltas (``_delta_fits``), else (or with ``whole``) a full
    snapshot, the new base.

    The copy records its own version, and the pointer the lake id, so that a build can tell
    whether a local catalog belongs to this lake and is as new as its newest snapshot.
    """
    pointer = read_pointer(lake, sealed=False)
    version = (pointer["version"] + 1) if pointer else 1
    keys = changes.take() if changes is not None else None
    try:
        if not whole and keys is not None and changes is not None and pointer is not None \
                and _delta_fits(pointer, changes):
            size, published = _publish_delta(con, lake, build_id, pointer, keys)
            changes.published_delta(version, size)
        else:
            size, published = _publish_base(con, lake, build_id, version)
            if changes is not None:
                changes.published_base(version, size)
    except BaseException:
        if changes is not None:
            changes.lost()
        raise
    _prune(lake, published)
    # Arrow's allocator keeps what a publish freed (a full one's reader index at a million chunks:
    # ~0.5 GB) for its next allocations; the driver has none that large until the next full one.
    pa.default_memory_pool().release_unused()
    return version


def _delta_fits(pointer: dict[str, Any], changes: ChangeLog) -> bool:
    """Whether the next publish may be a delta: the lake's current version is this writer's last
    publish, and its base would have at most MAX_WRITER_DELTAS deltas of at most DELTA_SHARE of
    its size."""
    return (changes.published == pointer["version"] and changes.base == base_version(pointer)
            and len(delta_versions(pointer)) < MAX_WRITER_DELTAS
            and changes.delta_bytes <= DELTA_SHARE * changes.base_bytes)


@contextlib.contextmanager
def _publishing(target: str, leftovers: list[str]) -> Iterator[None]:
    """Publishing to ``target`` (a file of the lake's ``_catalog/``): its errors made clear, a
    transient one left for the caller to retry; ``leftovers`` (local files) removed whatever
    happens, so none is left half-written."""
    try:
        yield
    except duckdb.Error as exc:
        raise catalog_failure(target, exc, "publishing the catalog snapshot") or exc
    except OSError as exc:
        if is_transient(exc):
            raise  # retried by the caller
        raise write_failure("publishing the catalog snapshot", target, exc) from exc
    finally:
        for leftover in leftovers:
            remove_quietly(leftover)


def _staging(lake: LakeLocation, target: str) -> str:
    staging = os.path.dirname(target) if lake.is_local else os.path.join(lake.cache_dir, "publish")
    os.makedirs(staging, exist_ok=True)
    return staging


def _publish_base(con: duckdb.DuckDBPyConnection, lake: LakeLocation, build_id: int | None,
                  version: int) -> tuple[int, dict[str, Any]]:
    """Publish a full snapshot (a DuckDB copy and its reader index) as ``version``; its bytes and
    its pointer."""
    name, prefix = snapshot_file(version), snapshot_prefix(version)
    files = {CATALOG_FILE: name, **{table: index_file(prefix, table) for table in TABLES}}
    con.execute(query("set_lake_meta"), {"key": "published_version", "value": str(version)})
    lake_id, _ = catalog_identity(con)
    target = lake.path_of(f"{SNAPSHOT_DIR}/{name}")
    staging = _staging(lake, target)
    temporary = {key: os.path.join(staging, f"{file}.tmp-{os.getpid()}") for key, file in files.items()}
    for path in temporary.values():
        remove_quietly(path)
    with _publishing(target, [*temporary.values(), f"{temporary[CATALOG_FILE]}.wal"]):
        _copy_catalog(con, temporary[CATALOG_FILE], temporary.__getitem__)
        checksums = {key: _sha256_file(path) for key, path in temporary.items()}
        size = sum(os.path.getsize(path) for path in temporary.values())
        for key in (*TABLES, CATALOG_FILE):   # the catalog file last: one in the lake has its index
            _place(lake, temporary[key], f"{SNAPSHOT_DIR}/{files[key]}")
        payload = {"version": version, "file": name, "reader_index": {"prefix": prefix, "format": INDEX_FORMAT},
                   "sha256": checksums, "published_at": time.time(), "build_id": build_id, "lake_id": lake_id}
        write_atomically(lake.url_of(POINTER), seal_pointer(payload), lake.storage_options)
    log.debug("published catalog snapshot %s", name)
    return size, payload


def _publish_delta(con: duckdb.DuckDBPyConnection, lake: LakeLocation, build_id: int | None,
                   pointer: dict[str, Any], keys: dict[str, set[int]]) -> tuple[int, dict[str, Any]]:
    """Publish the rows of chunks ``keys`` and the whole tables as a delta on ``pointer``'s base,
    the next version; its bytes and its pointer."""
    version = int(pointer["version"]) + 1
    name = delta_file(version)
    con.execute(query("set_lake_meta"), {"key": "published_version", "value": str(version)})
    target = lake.path_of(f"{SNAPSHOT_DIR}/{name}")
    temporary = os.path.join(_staging(lake, target), f"{name}.tmp-{os.getpid()}")
    remove_quietly(temporary)
    with _publishing(target, [temporary]):
        write_delta(con, keys, temporary)
        checksum, size = _sha256_file(temporary), os.path.getsize(temporary)
        _place(lake, temporary, f"{SNAPSHOT_DIR}/{name}")
        base = base_version(pointer)
        payload = {**{key: pointer[key] for key in ("file", "reader_index", "lake_id")},
                   "version": version, "base": base, "deltas": list(range(base + 1, version + 1)),
                   "sha256": {**pointer["sha256"], delta_key(version): checksum},
                   "published_at": time.time(), "build_id": build_id}
        write_atomically(lake.url_of(POINTER), seal_pointer(payload), lake.storage_options)
    log.debug("published catalog delta %s (%d chunks)", name, sum(len(v) for v in keys.values()))
    return size, payload


def _prune(lake: LakeLocation, pointer: dict[str, Any]) -> None:
    """Delete the published files of versions older than the newest KEEP_SNAPSHOTS that
    ``pointer`` (the current one) does not name: a reader of one of those versions has
    KEEP_SNAPSHOTS publishes' time to fetch it. A version's index and deltas go before its
    catalog file: a version without its catalog file is gone whole."""
    named = {_published_file(pointer, key) for key in _pointer_keys(pointer)}
    oldest = int(pointer["version"]) - KEEP_SNAPSHOTS
    try:
        listed = lake.fs.ls(lake.path_of(SNAPSHOT_DIR), detail=False)
    except FileNotFoundError:
        return
    stale = [path for path in listed if (match := _PUBLISHED.fullmatch(os.path.basename(path.rstrip("/"))))
             and int(match.group(1)) <= oldest and os.path.basename(path.rstrip("/")) not in named]
    for path in sorted(stale, key=lambda p: p.endswith(".duckdb")):
        lake.fs.rm_file(path)


def _pointer_keys(pointer: dict[str, Any]) -> list[str]:
    """The keys in ``sha256`` of every file ``pointer`` names."""
    index = pointer.get("reader_index")
    tables = list(TABLES) if isinstance(index, dict) and index.get("format") == INDEX_FORMAT else []
    return [CATALOG_FILE, *tables, *(delta_key(v) for v in delta_versions(pointer))]


def _place(lake: LakeLocation, staged: str, relative: str) -> None:
    """Move the finished local file ``staged`` to ``relative`` in the lake (a rename locally)."""
    if lake.is_local:
        os.replace(staged, lake.path_of(relative))
    else:
        lake.fs.put_file(staged, lake.path_of(relative))


def _newest(lake: LakeLocation, open_published: Callable[[dict[str, Any]], T]) -> T:
    """``open_published`` of the CURRENT pointer; once more with the pointer read again if the
    snapshot it names was pruned (or is unreadable) meanwhile."""
    for attempt in (1, 2):
        pointer = read_pointer(lake)
        if pointer is None:
            raise CatalogNotPublishedError(
                f"lake {lake.url} has no published catalog ({POINTER} is missing): start "
                "`lakeloader build` on it first; readers can start once its first snapshot is published"
            )
        try:
            return open_published(pointer)
        except (FileNotFoundError, duckdb.Error, CatalogError, pa.ArrowInvalid) as exc:
            if is_interrupt(exc) or (attempt == 2 and isinstance(exc, CatalogIntegrityError)):
                raise   # Ctrl-C while DuckDB opened it is the user's, never a reason to open it again
            if attempt == 2:
                raise CatalogError(f"cannot open the published catalog {pointer['file']} of {lake.url}: {exc}") from exc
    raise AssertionError("unreachable")


def open_snapshot(lake: LakeLocation, analyst_views: bool = True,
                  sql: SqlConfig | None = None) -> tuple[duckdb.DuckDBPyConnection, int]:
    """A read-only connection to the lake's newest published catalog, and its version (with the
    analyst views of catalog/views.sql unless ``analyst_views`` is false, within the limits of
    ``sql``: ``connect_reader``).

    The connection is ``connect_reader``'s: it runs no SQL stored in the snapshot and reaches
    nothing outside it, whoever wrote the lake.

    Remote lakes' snapshots are copied into the local cache first (DuckDB opens local files).
    A snapshot pruned between reading the pointer and opening it is retried once.
    """
    con, pointer = connect_newest(lake, analyst_views, sql)
    return con, int(pointer["version"])


def connect_newest(lake: LakeLocation, analyst_views: bool = True,
                   sql: SqlConfig | None = None) -> tuple[duckdb.DuckDBPyConnection, dict[str, Any]]:
    """:func:`open_snapshot`'s connection, with the CURRENT pointer of the snapshot it reads."""
    return _newest(lake, lambda pointer: (connect_pointer(lake, pointer, analyst_views, sql), pointer))


def connect_pointer(lake: LakeLocation, pointer: dict[str, Any], analyst_views: bool = True,
                    sql: SqlConfig | None = None) -> duckdb.DuckDBPyConnection:
    """``connect_reader`` of the snapshot ``pointer`` names (a FileNotFoundError once pruned)."""
    path = local_snapshot(lake, pointer)
    merged = published_deltas(lake, pointer)
    if merged is None:
        return connect_reader(path, analyst_views, sql)
    return connect_reader(path, analyst_views, sql, (merged.keys, merged.tables), _deltas_named(lake, pointer))


def open_reader_index(lake: LakeLocation, previous: ReaderIndex | None = None
                      ) -> tuple[dict[str, Any], ReaderIndex | None]:
    """The CURRENT pointer of the lake's newest snapshot and its reader index: its base's files
    memory-mapped, with the rows its deltas add (None for a snapshot without one this lakeloader
    reads: published before the index, or by a newer lakeloader in another format). Remote lakes'
    files are copied into the local cache first (a cached base is kept: a reader following a
    build fetches only the deltas it lacks; with the ``previous`` index of the same base, its
    memory-mapped and checked base is reused). Retried once, as :func:`open_snapshot`."""
    def open_index(pointer: dict[str, Any]) -> tuple[dict[str, Any], ReaderIndex | None]:
        index = pointer.get("reader_index")
        if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
            return pointer, None   # an older lakeloader's snapshot, or a newer one's format: SQL
        identity = (pointer.get("lake_id"), *(pointer.get("sha256", {}).get(table) for table in TABLES))
        if previous is not None and previous.base_identity == identity:   # checked when first opened
            files = previous.paths
        else:
            files = {table: local_snapshot(lake, pointer, table) for table in TABLES}
        merged = published_deltas(lake, pointer)
        if merged is None:
            return pointer, ReaderIndex(files, previous=previous, base_identity=identity)
        return pointer, ReaderIndex(files, merged.index, merged.changed(), _deltas_named(lake, pointer),
                                    previous, identity)

    return _newest(lake, open_index)


def _deltas_named(lake: LakeLocation, pointer: dict[str, Any]) -> str:
    """The deltas of ``pointer`` as one name for errors."""
    versions = delta_versions(pointer)
    return lake.url_of(f"{SNAPSHOT_DIR}/{delta_file(versions[0])}") + (
        f" to {delta_file(versions[-1])}" if len(versions) > 1 else "")


def published_deltas(lake: LakeLocation, pointer: dict[str, Any]) -> Merged | None:
    """What the deltas of ``pointer`` add to its base (None: it names none), each delta's bytes
    checked against its sha256 (``local_snapshot``) and its data against what lakeloader writes:
    a CatalogIntegrityError naming the delta if not."""
    versions = delta_versions(pointer)
    if not versions:
        return None
    deltas = []
    for version in versions:
        path = local_snapshot(lake, pointer, delta_key(version))
        try:
            deltas.append(_read_delta(path, pointer["sha256"][delta_key(version)]))
        except (pa.ArrowException, ValueError, KeyError, TypeError) as exc:
            raise _altered_delta(lake, version, exc) from exc
    try:
        return merge(deltas)
    except (pa.ArrowException, ValueError, KeyError, TypeError) as exc:
        raise _altered_delta(lake, versions[-1], exc) from exc


@functools.lru_cache(maxsize=2 * MAX_DELTAS)
def _read_delta(path: str, sha256: str) -> Delta:
    """``read_delta`` of the file at ``path`` whose bytes were just found to have ``sha256``: kept,
    so a reader following a build parses each delta once."""
    return read_delta(path)


def _altered_delta(lake: LakeLocation, version: int, exc: Exception) -> CatalogIntegrityError:
    return CatalogIntegrityError(
        f"the published catalog delta {lake.url_of(f'{SNAPSHOT_DIR}/{delta_file(version)}')} is not as lakeloader "
        f"writes it ({type(exc).__name__}: {' '.join(str(exc).split())}): the lake was altered; read only lakes "
        "from people you trust, and if this lake is yours `lakeloader build CONFIG` publishes a whole catalog again")


def materialise(lake: LakeLocation, pointer: dict[str, Any], target: str) -> None:
    """Write to the local path ``target`` the whole catalog of the version ``pointer`` names: its
    base with its deltas applied, in the tables of the schema with their keys (for a build
    adopting the lake's catalog: ``writer_catalog_from``)."""
    temporary, keyed = f"{target}.tmp-{os.getpid()}", f"{target}.keyed-{os.getpid()}"
    shutil.copyfile(local_snapshot(lake, pointer), temporary)
    try:
        merged = published_deltas(lake, pointer)
        if merged is not None:
            apply_deltas(temporary, merged)
        writer_catalog_from(temporary, keyed)
        os.replace(keyed, target)
    finally:
        for leftover in (temporary, f"{temporary}.wal", keyed, f"{keyed}.wal"):
            remove_quietly(leftover)


def _published_file(pointer: dict[str, Any], key: str) -> str:
    """The name in ``_catalog/`` of the snapshot file ``key`` (CATALOG_FILE, a reader-index table
    or a delta: ``delta_key``)."""
    if key == CATALOG_FILE:
        return pointer["file"]
    if key.startswith("delta-"):
        return delta_file(int(key.removeprefix("delta-")))
    return index_file(pointer["reader_index"]["prefix"], key)


def _mismatch(lake: LakeLocation, pointer: dict[str, Any], key: str) -> CatalogIntegrityError:
    return CatalogIntegrityError(
        f"the published catalog file {lake.url_of(f'{SNAPSHOT_DIR}/{_published_file(pointer, key)}')} is damaged "
        f"or was altered: its sha256 is not the one {lake.url_of(POINTER)} gives. If this lake is yours, "
        "`lakeloader build CONFIG` publishes a whole catalog again; read only lakes from people you trust")


def local_snapshot(lake: LakeLocation, pointer: dict[str, Any], key: str = CATALOG_FILE) -> str:
    """Local path of the snapshot ``pointer`` names, or of its reader index's table ``key``
    (downloaded into the cache for remote lakes), whose bytes have the sha256 the pointer gives
    (a CatalogIntegrityError naming the file if not).

    A local lake's file is hashed once per machine while it is unchanged (``HashRecords``); a
    remote lake's is hashed as it is downloaded, and only a copy that matches enters the cache.
    Cached copies are kept per lake id: a lake re-created at the same URL numbers its snapshots
    from 1 again, and must never be read through the old lake's copies. Copies of versions the
    lake itself no longer keeps are deleted as a newer one arrives (a reader following a build
    fetches each version it reads).
    """
    # Only a build takes a pointer without checksums (``read_pointer``): it adopts that snapshot as is.
    name, expected = _published_file(pointer, key), pointer.get("sha256", {}).get(key)
    remote = lake.path_of(f"{SNAPSHOT_DIR}/{name}")
    if lake.is_local:
        with open(remote, "rb") as handle:   # FileNotFoundError once pruned
            if expected is not None and HashRecords(lake.cache_dir).sha256(remote, handle, expected) != expected:
                raise _mismatch(lake, pointer, key)
        return remote
    local = os.path.join(lake.cache_dir, "snapshots", pointer.get("lake_id") or "no-lake-id", name)
    if not os.path.exists(local):
        os.makedirs(os.path.dirname(local), exist_ok=True)
        # Unique per call: threads of one process may fetch the same snapshot at once.
        temporary = f"{local}.tmp-{uuid.uuid4().hex}"
        try:
            lake.fs.get_file(remote, temporary)
            if expected is not None and _sha256_file(temporary) != expected:
                raise _mismatch(lake, pointer, key)
            os.replace(temporary, local)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
        _prune_cached(os.path.dirname(local), pointer)
    return local


def _prune_cached(folder: str, pointer: dict[str, Any]) -> None:
    """Delete the cached copies in ``folder`` of snapshot versions older than the newest
    KEEP_SNAPSHOTS as of ``pointer`` that it does not name (pruned from the lake too). A process
    still reading one keeps its open file (POSIX); one about to open it finds it gone and reads a
    newer snapshot."""
    named = {_published_file(pointer, key) for key in _pointer_keys(pointer)}
    for path in glob.glob(os.path.join(folder, "catalog-*")):
        match = _PUBLISHED.fullmatch(os.path.basename(path))
        if match and int(match.group(1)) <= int(pointer["version"]) - KEEP_SNAPSHOTS \
                and os.path.basename(path) not in named:
            remove_quietly(path)
