"""``lakeloader gc``: remove the stale chunk folders of replaced dataset plans, the documents index
files no longer recorded and the media files no longer read, never while a build runs."""

from __future__ import annotations

import logging
import os

import duckdb
import pandas as pd

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.sql import query
from lakeloader.catalog.stale import stale_paths
from lakeloader.catalog.store import catalog_failure, is_lock_error
from lakeloader.contracts.errors import CatalogError, CatalogLockedError, LakeWriteError

log = logging.getLogger(__name__)


def _hold_catalog(lake: Lake) -> duckdb.DuckDBPyConnection | None:
    """Take the lake's catalog lock (a local lake's catalog opened read-write) so that no build
    starts while folders are removed; for a remote lake, refuse if a build is recorded running."""
    path = lake.writer_catalog_path
    if lake.is_local:
        if not os.path.exists(path):
            raise CatalogError(f"no catalog at {path}: nothing was built in this lake")
        try:
            return duckdb.connect(path)
        except duckdb.Error as exc:
            if is_lock_error(exc):
                raise CatalogLockedError(
                    f"catalog {path} is in use (a `lakeloader build` of this lake, or a process reading "
                    "its catalog directly): run `lakeloader gc` when the build has finished") from exc
            failure = catalog_failure(path, exc)
            if isinstance(failure, LakeWriteError):   # a read-only lake, say: removing folders writes
                raise LakeWriteError(
                    f"`lakeloader gc` cannot open the catalog {path} for writing ({' '.join(str(exc).split())}): "
                    "it holds the catalog while it removes folders, so run it where the lake is writable "
                    "(`lakeloader gc --dry-run` only reads)") from exc
            raise failure or exc
    con = lake.connect()
    try:
        running = con.execute(query("running_builds")).fetchall()
    finally:
        con.close()
    if running:
        described = ", ".join(f"build {b} (host {h}, pid {p})" for b, h, p in running)
        raise CatalogLockedError(
            f"lake {lake.url} has a build recorded as running: {described}. Run `lakeloader gc` when it "
            "has finished (a killed build is marked interrupted by the next `lakeloader build`)")
    return None


def remove_stale(lake: Lake, *, dry_run: bool = False) -> pd.DataFrame:
    """Remove the lake's stale chunk folders, documents index files and media files (see
    :func:`stale_paths`) and return them.

    Refuses while a build holds the catalog, and holds a local lake's catalog lock meanwhile so
    that no build starts. Never touches the folders of the plans in force; a reader still on a
    replaced plan would lose its files, which is why this is an explicit command.
    ``dry_run`` only lists them: it reads the catalog as any reader does (read-only; the published
    snapshot while a build holds the catalog), so it works on a read-only lake and beside a build."""
    if dry_run:
        con = lake.connect()
        try:
            return stale_paths(lake, con)
        except duckdb.Error as exc:
            raise lake.catalog_damage(exc) or exc
        finally:
            con.close()
    holder = _hold_catalog(lake)
    con = holder.cursor() if holder is not None else lake.connect()
    try:
        stale = stale_paths(lake, con)
        for folder in stale["folder"]:
            log.info("removing stale %s", folder)
            lake.fs.rm(lake.path_of(folder), recursive=True)
        return stale
    except duckdb.Error as exc:
        raise lake.catalog_damage(exc) or exc
    finally:
        con.close()
        if holder is not None:
            holder.close()
