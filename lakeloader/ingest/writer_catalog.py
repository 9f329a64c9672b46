"""The build's writer catalog: made the lake's own before a build opens it (adopting the lake's
published snapshot where the local file is missing, foreign or stale), and published back to the
lake as snapshots for readers."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import duckdb

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.pointer import POINTER
from lakeloader.catalog.snapshot import catalog_identity, materialise, publish_snapshot, read_pointer
from lakeloader.catalog.store import RECOVER_CATALOG_HINT, CatalogWriter, catalog_failure, connect_reader
from lakeloader.config import Config
from lakeloader.contracts.errors import CatalogError
from lakeloader.storage import missing_bucket, with_retries

log = logging.getLogger(__name__)


def _catalog_identity_of(path: str) -> tuple[str | None, int]:
    """Lake id and published version of the catalog file at ``path`` (opened read-only)."""
    con = connect_reader(path)  # a build holding it raises CatalogLockedError: let it through
    try:
        return catalog_identity(con)
    finally:
        con.close()


def _set_aside(lake: Lake, path: str, why: str) -> None:
    """Remove the writer catalog at ``path`` (and its WAL): a local lake's is moved aside, never
    deleted; a remote lake's is only this host's cache and is deleted."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for file in (path, f"{path}.wal"):
        if not os.path.exists(file):
            continue
        if lake.is_local:
            os.replace(file, f"{file}.{why}-{stamp}")
            log.warning("moved %s aside to %s", file, f"{file}.{why}-{stamp}")
        else:
            os.remove(file)


def _adopt(lake: Lake, pointer: dict[str, Any], why: str) -> None:
    path = lake.writer_catalog_path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with_retries(lambda: materialise(lake, pointer, path), deadline=lake.io_retry_deadline,
                 what=f"reading the published catalog of {lake.describe()}")
    log.warning("%s: adopting the lake's published catalog (snapshot version %d of lake %s) as the "
                "writer catalog %s", why, pointer["version"], pointer.get("lake_id"), path)


def prepare_writer_catalog(lake: Lake, recover: bool) -> None:
    """Make the writer catalog the lake's own before a build opens it.

    A local catalog is used only if it belongs to this lake (same lake id as the published
    snapshot) and is not older than the lake's newest snapshot; otherwise the snapshot is
    adopted, or (a remote lake with nothing published: an empty lake) the build starts fresh.
    ``recover`` sets a local catalog aside and adopts the newest snapshot whatever it holds.
    """
    path = lake.writer_catalog_path
    pointer = with_retries(lambda: read_pointer(lake, sealed=False), deadline=lake.io_retry_deadline,
                           what=f"reading the published catalog of {lake.describe()}")
    missing = missing_bucket(lake.fs, lake.root, f"lake {lake.describe()}") if pointer is None else None
    if missing is not None:   # before anything is set aside for a lake that cannot be written
        raise missing
    if recover:
        if pointer is None:
            raise CatalogError(
                f"--recover-catalog: lake {lake.url} has no published catalog snapshot ({POINTER}) to "
                "recover from; delete the lake and build it again")
        _set_aside(lake, path, "damaged")
        _adopt(lake, pointer, "--recover-catalog")
        return
    if not os.path.exists(path):
        if pointer is not None:
            _adopt(lake, pointer, f"no writer catalog at {path}")
        else:
            log.info("lake %s has no catalog yet: starting a new lake", lake.url)
        return
    try:
        lake_id, version = _catalog_identity_of(path)
    except duckdb.Error as exc:
        raise catalog_failure(path, exc) or CatalogError(
            f"the catalog {path} of lake {lake.url} cannot be opened ({type(exc).__name__}: {exc}); "
            f"{RECOVER_CATALOG_HINT}") from exc
    if pointer is None:
        if lake.is_local:
            return  # the catalog lives in the lake itself: it is the lake's
        log.warning("the local catalog %s (lake %s) is for a lake with published snapshots, but %s has "
                    "none: the lake is empty, starting a fresh one", path, lake_id, lake.url)
        _set_aside(lake, path, "stale")
        return
    published_id = pointer.get("lake_id")
    if lake_id is None and published_id is None:
        return  # a lake from before lake ids: nothing to compare
    if lake_id != published_id:
        why = f"the local catalog {path} belongs to lake {lake_id}, {lake.url} is lake {published_id}"
    elif version < int(pointer["version"]):
        why = (f"the local catalog {path} is as of snapshot version {version}, older than the lake's "
               f"newest snapshot {pointer['version']}")
    else:
        log.info("using the writer catalog %s (lake %s, snapshot version %d)", path, lake_id, version)
        return
    _set_aside(lake, path, "replaced")
    _adopt(lake, pointer, why)


def publish(writer: CatalogWriter, lake: Lake, build_id: int, config: Config, whole: bool = False) -> None:
    """Publish the writer catalog as the lake's newest snapshot (retried on transient errors): a
    delta of what changed since the writer's last publish where it can, a full snapshot with
    ``whole`` (a build's end: a finished lake is one full snapshot)."""
    with_retries(lambda: publish_snapshot(writer.con, lake, build_id, writer.changes, whole),
                 what=f"publishing the catalog snapshot of {lake.describe()}", deadline=config.io_retry_deadline)
