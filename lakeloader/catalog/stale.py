"""Chunk folders of replaced dataset plans (listed by ``lakeloader status``), documents index files
no longer recorded (replaced by a compaction, or left by a killed build), and media files no longer
read (replaced by a build's end rewriting them, see ingest/media_dedup.py): removed by ``lakeloader gc``.

A dataset whose build settings change (tokenizer, format, fields or split size) gets a new
chunk folder ``<dataset>/<settings fingerprint[:16]>``; the old folder is never read again but
stays in the lake until it is removed here. (Sources coming or going keep the folder: chunk files
are named per source file, and those of a removed file are not listed here.)
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from typing import Any

import pandas as pd

from lakeloader.catalog.location import LakeLocation
from lakeloader.catalog.sql import query
from lakeloader.contracts.media import media_path

STALE_COLUMNS = ["dataset", "folder", "files", "bytes"]
_FINGERPRINT_FOLDER = re.compile(r"^[0-9a-f]{16}$")
_DEDUPED_MEDIA = re.compile(r"\.media\.[0-9a-f]{16}\.parquet$")   # contracts/media.py deduped_media_path
INDEX_DIR = "_documents"   # documents index files: <INDEX_DIR>/<index_folder digest>/<file>.parquet


def index_folder(dataset: str) -> str:
    """The folder (relative to the lake) of dataset ``dataset``'s documents index files."""
    digest = hashlib.sha256((dataset + "\n").encode()).hexdigest()[:16]
    return f"{INDEX_DIR}/{digest}"


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
    return _stale_frame(rows)


def stale_index_files(lake: LakeLocation, con: Any) -> pd.DataFrame:
    """Files under the documents index folder that the catalog (``con``) records none of: those a
    compaction replaced (kept for readers of earlier snapshots until ``gc``) and those of a build
    killed before it committed them; one row each (``files`` 1), named by the dataset whose folder
    holds it where that is one of the lake's datasets."""
    if not con.execute(query("has_document_index")).fetchone()[0]:
        return _stale_frame([])
    recorded = {path for (path,) in con.execute(query("document_index_paths")).fetchall()}
    names = {index_folder(name): name for (name,) in con.execute(query("dataset_plan_names")).fetchall()}
    folder = lake.path_of(INDEX_DIR).rstrip("/")
    try:
        found = lake.fs.find(folder, detail=True)
    except FileNotFoundError:
        found = {}
    rows = []
    for full, info in sorted(found.items()):
        path = INDEX_DIR + full[len(folder):]
        if info.get("type") == "file" and path not in recorded:
            rows.append((names.get(path.rsplit("/", 1)[0], ""), path, 1, int(info["size"])))
    return _stale_frame(rows)


def stale_media_files(lake: LakeLocation, con: Any) -> pd.DataFrame:
    """Media files in the folders of committed chunks storing images that the catalog (``con``)
    reads none of: a chunk's own media file once a build's end rewrote it (kept for readers of
    earlier snapshots until ``gc``), and rewritten ones no longer recorded (of a re-plan, or of a
    build killed before it recorded them); one row each (``files`` 1)."""
    if not con.execute(query("has_media_files")).fetchone()[0]:
        return _stale_frame([])
    rows = con.execute(query("media_file_paths")).fetchall()
    read = {deduped or media_path(chunk) for _, chunk, deduped in rows}
    replaced = {media_path(chunk) for _, chunk, deduped in rows if deduped}
    folders: dict[str, str] = {posixpath.dirname(chunk): dataset for dataset, chunk, _ in rows}
    found = []
    for folder, dataset in sorted(folders.items()):
        try:
            entries = lake.fs.ls(lake.path_of(folder), detail=True)
        except FileNotFoundError:
            continue
        for entry in entries:
            path = f"{folder}/{entry['name'].rstrip('/').rsplit('/', 1)[-1]}"
            if entry["type"] == "file" and path not in read and (path in replaced or _DEDUPED_MEDIA.search(path)):
                found.append((dataset, path, 1, int(entry["size"])))
    return _stale_frame(found)


def _stale_frame(rows: list[tuple[str, str, int, int]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=STALE_COLUMNS).astype({"files": "int64", "bytes": "int64"})


def stale_paths(lake: LakeLocation, con: Any) -> pd.DataFrame:
    """What ``lakeloader gc`` removes: the stale chunk folders, then the stale documents index files."""
    frames = [stale_chunk_folders(lake, con), stale_index_files(lake, con), stale_media_files(lake, con)]
    return pd.concat([frame for frame in frames if len(frame)] or frames[:1], ignore_index=True)
