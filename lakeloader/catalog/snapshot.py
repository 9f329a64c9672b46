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
from typing import TYPE_CHECKING, Any

import duckdb

from lakeloader.storage import write_atomically
from lakeloader.errors import CatalogError

if TYPE_CHECKING:
    from lakeloader.lake import Lake

log = logging.getLogger(__name__)

SNAPSHOT_DIR = "_catalog"
POINTER = f"{SNAPSHOT_DIR}/CURRENT"
KEEP_SNAPSHOTS = 3
SNAPSHOT_BLOCK_SIZE = 16384


def read_pointer(lake: Lake) -> dict[str, Any] | None:
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


def publish_snapshot(con: duckdb.DuckDBPyConnection, lake: Lake, build_id: int | None) -> int:
    """Publish a copy of the writer's catalog as the lake's next snapshot version."""
    pointer = read_pointer(lake)
    version = (pointer["version"] + 1) if pointer else 1
    name = f"catalog-{version:06d}.duckdb"
    target = lake.path_of(f"{SNAPSHOT_DIR}/{name}")
    staged = target if lake.is_local else os.path.join(lake.cache_dir, "publish", name)
    os.makedirs(os.path.dirname(staged), exist_ok=True)
    temporary = f"{staged}.tmp-{os.getpid()}"
    if os.path.exists(temporary):
        os.remove(temporary)
    _copy_catalog(con, temporary)
    if lake.is_local:
        os.replace(temporary, target)
    else:
        try:
            lake.fs.put_file(temporary, target)
        finally:
            os.remove(temporary)
    payload = {"version": version, "file": name, "published_at": time.time(), "build_id": build_id}
    write_atomically(lake.url_of(POINTER), json.dumps(payload).encode(), lake.storage_options)
    for old in range(max(1, version - KEEP_SNAPSHOTS - 5), version - KEEP_SNAPSHOTS + 1):
        stale = lake.path_of(f"{SNAPSHOT_DIR}/catalog-{old:06d}.duckdb")
        if lake.fs.exists(stale):
            lake.fs.rm_file(stale)
    log.debug("published catalog snapshot %s", name)
    return version


def open_snapshot(lake: Lake) -> tuple[duckdb.DuckDBPyConnection, int]:
    """A read-only connection to the lake's newest published catalog, and its version.

    Remote lakes' snapshots are copied into the local cache first (DuckDB opens local files).
    A snapshot pruned between reading the pointer and opening it is retried once.
    """
    for attempt in (1, 2):
        pointer = read_pointer(lake)
        if pointer is None:
            raise CatalogError(
                f"lake {lake.url} has no published catalog ({POINTER} is missing): start "
                "`lakeloader build` on it first; readers can start once its first snapshot is published"
            )
        try:
            return duckdb.connect(local_snapshot(lake, pointer["file"]), read_only=True), int(pointer["version"])
        except (FileNotFoundError, duckdb.Error) as exc:
            if attempt == 2:
                raise CatalogError(f"cannot open the published catalog {pointer['file']} of {lake.url}: {exc}") from exc
    raise AssertionError("unreachable")


def local_snapshot(lake: Lake, name: str) -> str:
    """Local path of published snapshot ``name`` (downloaded into the cache for remote lakes)."""
    remote = lake.path_of(f"{SNAPSHOT_DIR}/{name}")
    if lake.is_local:
        if not os.path.exists(remote):
            raise FileNotFoundError(remote)
        return remote
    local = os.path.join(lake.cache_dir, "snapshots", name)
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
