"""Chunk folders of replaced dataset plans: listed by ``lakeloader status``, removed by ``lakeloader gc``.

A dataset whose build settings change (tokenizer, format, fields or split size) gets a new
chunk folder ``<dataset>/<settings fingerprint[:16]>``; the old folder is never read again but
stays in the lake until it is removed here. (Sources coming or going keep the folder: chunk files
are named per source file, and those of a removed file are not listed here.)
"""

from __future__ import annotations

import re
from typing import Any

import pandas as pd

from lakeloader.catalog.location import LakeLocation
from lakeloader.catalog.sql import query

STALE_COLUMNS = ["dataset", "folder", "files", "bytes"]
_FINGERPRINT_FOLDER = re.compile(r"^[0-9a-f]{16}$")


def stale_chunk_folders(lake: LakeLocation, con: Any) -> pd.DataFrame:
    """Chunk folders ``<dataset>/<16 hex digits>`` of the lake's datasets whose files the catalog
    (``con``: a connection to it) reads none of, neither as a plan in force nor as a chunk of a
    filtered dataset, with their file count and size in bytes."""
    rows = []
    live = {folder for (folder,) in con.execute(query("live_chunk_folders")).fetchall()}
    for name in sorted({folder.split("/", 1)[0] for folder in live}):
        root = lake.path_of(name)
        try:
            entries = lake.fs.ls(root, detail=True)
        except FileNotFoundError:
            continue
        for entry in entries:
            folder = f"{name}/{entry['name'].rstrip('/').rsplit('/', 1)[-1]}"
            if entry["type"] != "directory" or folder in live or not _FINGERPRINT_FOLDER.match(folder.rsplit("/", 1)[-1]):
                continue
            sizes = [info["size"] for info in lake.fs.find(entry["name"], detail=True).values()]
            rows.append((name, folder, len(sizes), int(sum(sizes))))
    return pd.DataFrame(rows, columns=STALE_COLUMNS).astype({"files": "int64", "bytes": "int64"})
