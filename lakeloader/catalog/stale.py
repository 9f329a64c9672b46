"""Chunk folders of replaced dataset plans: listed by ``lakeloader status``, removed by ``lakeloader gc``.

A dataset whose build settings change (tokenizer, format, fields or split size) gets a new
chunk folder ``<dataset>/<settings fingerprint[:16]>``; the old folder is never read again but
stays in the lake until it is removed here. (Sources coming or going keep the folder: chunk files
are named per source file, and those of a removed file are not listed here.)
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Any

import duckdb
import pandas as pd

from lakeloader.catalog.sql import query
from lakeloader.errors import CatalogError, CatalogLockedError

if TYPE_CHECKING:
    from lakeloader.lake import Lake

log = logging.getLogger(__name__)

STALE_COLUMNS = ["dataset", "folder", "files", "bytes"]
_FINGERPRINT_FOLDER = re.compile(r"^[0-9a-f]{16}$")


def stale_chunk_folders(lake: Lake, con: Any) -> pd.DataFrame:
    """Chunk folders ``<dataset>/<16 hex digits>`` of the lake's datasets that no plan in force
    uses (``con``: a catalog connection), with their file count and size in bytes."""
    rows = []
    for name, live in con.execute(query("live_chunk_folders")).fetchall():
        root = lake.path_of(name)
        try:
            entries = lake.fs.ls(root, detail=True)
        except FileNotFoundError:
            continue
        for entry in entries:
            folder = f"{name}/{entry['name'].rstrip('/').rsplit('/', 1)[-1]}"
            if entry["type"] != "directory" or folder == live or not _FINGERPRINT_FOLDER.match(folder.rsplit("/", 1)[-1]):
                continue
            sizes = [info["size"] for info in lake.fs.find(entry["name"], detail=True).values()]
            rows.append((name, folder, len(sizes), int(sum(sizes))))
    return pd.DataFrame(rows, columns=STALE_COLUMNS).astype({"files": "int64", "bytes": "int64"})


def _hold_catalog(lake: Lake) -> duckdb.DuckDBPyConnection | None:
    """Take the lake's catalog lock (a local lake's catalog opened read-write) so that no build
    starts while folders are removed; for a remote lake, refuse if a build is recorded running."""
    path = lake.writer_catalog_path
    if lake.is_local:
        if not os.path.exists(path):
            raise CatalogError(f"no catalog at {path}: nothing was built in this lake")
        try:
            return duckdb.connect(path)
        except duckdb.IOException as exc:
            if "lock" not in str(exc).lower():
                raise
            raise CatalogLockedError(
                f"catalog {path} is in use (a `lakeloader build` of this lake, or a process reading "
                "its catalog directly): run `lakeloader gc` when the build has finished") from exc
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


def remove_stale_chunk_folders(lake: Lake, *, dry_run: bool = False) -> pd.DataFrame:
    """Remove the lake's stale chunk folders (see :func:`stale_chunk_folders`) and return them.

    Refuses while a build holds the catalog, and holds a local lake's catalog lock meanwhile so
    that no build starts. Never touches the folders of the plans in force; a reader still on a
    replaced plan would lose its files, which is why this is an explicit command.
    ``dry_run`` only lists them."""
    holder = _hold_catalog(lake)
    con = holder.cursor() if holder is not None else lake.connect()
    try:
        stale = stale_chunk_folders(lake, con)
        if not dry_run:
            for folder in stale["folder"]:
                log.info("removing stale chunk folder %s", folder)
                lake.fs.rm(lake.path_of(folder), recursive=True)
        return stale
    finally:
        con.close()
        if holder is not None:
            holder.close()
