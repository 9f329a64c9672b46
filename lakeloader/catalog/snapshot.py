"""Published read-only copies of the catalog in the lake, for readers in other processes/hosts.

Layout: ``<lake>/_catalog/catalog-<version>.duckdb`` plus ``<lake>/_catalog/CURRENT``, a small JSON
pointer replaced atomically after the snapshot it names is complete.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from typing import Any

import duckdb

from lakeloader.catalog.location import LakeLocation
from lakeloader.catalog.sql import query
from lakeloader.catalog.store import catalog_failure, connect_reader
from lakeloader.contracts.errors import CatalogError, CatalogNotPublishedError
from lakeloader.storage import is_transient, remove_quietly, write_atomically, write_failure

log = logging.getLogger(__name__)

SNAPSHOT_DIR = "_catalog"
POINTER = f"{SNAPSHOT_DIR}/CURRENT"
KEEP_SNAPSHOTS = 3
SNAPSHOT_BLOCK_SIZE = 16384


def read_pointer(lake: LakeLocation) -> dict[str, Any] | None:
    """The CURRENT pointer of the lake's published catalog, or None if nothing is published."""
    try:
        return json.loads(lake.fs.cat_file(lake.path_of(POINTER)))
    except FileNotFoundError:
        return None


def _copy_catalog(con: duckdb.DuckDBPyConnection, target: str) -> None:
    """Copy the writer's open catalog into a new DuckDB file through the writer's own connection.

    The catalog file must not be opened any other way in the writer's process: DuckDB guards it
    with a POSIX record lock, which the process loses as soon as it closes *any* descriptor of the
    file, so a plain file copy would silently let a second build open the catalog for writing.
    """
    database = con.execute("SELECT current_database()").fetchone()[0]
    # The smallest block size: with the default 256 KiB blocks every table and index takes
    # whole blocks, so even an empty catalog's copy was about 5 MB.
    con.execute(f"ATTACH ? AS published_snapshot (BLOCK_SIZE {SNAPSHOT_BLOCK_SIZE})", [target])
    try:
        con.execute(f'COPY FROM DATABASE "{database}" TO published_snapshot')
    finally:
        con.execute("DETACH published_snapshot")


def catalog_identity(con: duckdb.DuckDBPyConnection) -> tuple[str | None, int]:
    """The lake id a catalog belongs to (None for catalogs from before lake ids) and the newest
    snapshot version it was published as (0 if never)."""
    def value(key: str) -> str | None:
        row = con.execute(query("lake_meta_value"), {"key": key}).fetchone()
        return row[0] if row else None

    return value("lake_id"), int(value("published_version") or 0)


def publish_snapshot(con: duckdb.DuckDBPyConnection, lake: LakeLocation, build_id: int | None) -> int:
    """Publish a copy of the writer's catalog as the lake's next snapshot version.

    The copy records its own version, and the pointer the lake id, so that a build can tell
    whether a local catalog belongs to this lake and is as new as its newest snapshot.
    """
    pointer = read_pointer(lake)
    version = (pointer["version"] + 1) if pointer else 1
    name = f"catalog-{version:06d}.duckdb"
    con.execute(query("set_lake_meta"), {"key": "published_version", "value": str(version)})
    lake_id, _ = catalog_identity(con)
    target = lake.path_of(f"{SNAPSHOT_DIR}/{name}")
    staged = target if lake.is_local else os.path.join(lake.cache_dir, "publish", name)
    os.makedirs(os.path.dirname(staged), exist_ok=True)
    temporary = f"{staged}.tmp-{os.getpid()}"
    remove_quietly(temporary)
    try:
        _copy_catalog(con, temporary)
        if lake.is_local:
            os.replace(temporary, target)
        else:
            lake.fs.put_file(temporary, target)
        payload = {"version": version, "file": name, "published_at": time.time(), "build_id": build_id,
                   "lake_id": lake_id}
        write_atomically(lake.url_of(POINTER), json.dumps(payload).encode(), lake.storage_options)
    except duckdb.Error as exc:
        raise catalog_failure(target, exc, "publishing the catalog snapshot") or exc
    except OSError as exc:
        if is_transient(exc):
            raise  # retried by the caller
        raise write_failure("publishing the catalog snapshot", target, exc) from exc
    finally:
        for leftover in (temporary, f"{temporary}.wal"):  # gone once moved; never left half-written
            remove_quietly(leftover)
    for old in range(max(1, version - KEEP_SNAPSHOTS - 5), version - KEEP_SNAPSHOTS + 1):
        stale = lake.path_of(f"{SNAPSHOT_DIR}/catalog-{old:06d}.duckdb")
        if lake.fs.exists(stale):
            lake.fs.rm_file(stale)
    log.debug("published catalog snapshot %s", name)
    return version


def open_snapshot(lake: LakeLocation, analyst_views: bool = True) -> tuple[duckdb.DuckDBPyConnection, int]:
    """A read-only connection to the lake's newest published catalog, and its version (with the
    analyst views of catalog/views.sql unless ``analyst_views`` is false: ``connect_reader``).

    The connection is ``connect_reader``'s: it runs no SQL stored in the snapshot and reaches
    nothing outside it, whoever wrote the lake.

    Remote lakes' snapshots are copied into the local cache first (DuckDB opens local files).
    A snapshot pruned between reading the pointer and opening it is retried once.
    """
    for attempt in (1, 2):
        pointer = read_pointer(lake)
        if pointer is None:
            raise CatalogNotPublishedError(
                f"lake {lake.url} has no published catalog ({POINTER} is missing): start "
                "`lakeloader build` on it first; readers can start once its first snapshot is published"
            )
        try:
            return connect_reader(local_snapshot(lake, pointer), analyst_views), int(pointer["version"])
        except (FileNotFoundError, duckdb.Error, CatalogError) as exc:
            if attempt == 2:
                raise CatalogError(f"cannot open the published catalog {pointer['file']} of {lake.url}: {exc}") from exc
    raise AssertionError("unreachable")


def local_snapshot(lake: LakeLocation, pointer: dict[str, Any]) -> str:
    """Local path of the snapshot ``pointer`` names (downloaded into the cache for remote lakes).

    Cached copies are kept per lake id: a lake re-created at the same URL numbers its snapshots
    from 1 again, and must never be read through the old lake's copies.
    """
    name = pointer["file"]
    remote = lake.path_of(f"{SNAPSHOT_DIR}/{name}")
    if lake.is_local:
        if not os.path.exists(remote):
            raise FileNotFoundError(remote)
        return remote
    local = os.path.join(lake.cache_dir, "snapshots", pointer.get("lake_id") or "no-lake-id", name)
    if not os.path.exists(local):
        os.makedirs(os.path.dirname(local), exist_ok=True)
        # Unique per call: threads of one process may fetch the same snapshot at once.
        temporary = f"{local}.tmp-{uuid.uuid4().hex}"
        try:
            lake.fs.get_file(remote, temporary)
            os.replace(temporary, local)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
    return local
