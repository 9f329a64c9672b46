"""Checking every committed chunk of a lake against its catalog record."""

from __future__ import annotations

import os
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
from tqdm import tqdm

from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.catalog.sql import query
from lakeloader.config import Config
from lakeloader.contracts.chunk_file import sha256_mismatch, size_mismatch
from lakeloader.contracts.media import media_path
from lakeloader.storage import sha256_of


def _problem(lake: Lake, path: str, num_bytes: int, checksum: str, num_docs: int) -> tuple[str, str]:
    full = lake.path_of(path)
    try:
        size = lake.fs.size(full)
    except FileNotFoundError:
        return "missing", "the file does not exist"
    if size != num_bytes:
        return "size", size_mismatch(size, num_bytes)
    with lake.fs.open(full, "rb") as handle:
        digest = sha256_of(handle)
        if digest != checksum:
            return "checksum", sha256_mismatch(digest, checksum)
        try:
            handle.seek(0)
            rows = pq.ParquetFile(handle).metadata.num_rows
        except Exception as exc:  # reported as a finding, not raised: verify lists every problem
            return "unreadable", f"{type(exc).__name__}: {exc}"
    if rows != num_docs:
        return "rows", f"{rows} documents, the catalog says {num_docs}"
    return "ok", ""


def _media_problem(lake: Lake, path: str, num_bytes: int, checksum: str) -> tuple[str, str]:
    """What is wrong with the media file (its images) of the chunk at ``path``, if anything."""
    full = lake.path_of(media_path(path))
    try:
        size = lake.fs.size(full)
    except FileNotFoundError:
        return "missing", f"its media file {media_path(path)} does not exist"
    if size != num_bytes:
        return "size", f"its media file has {size_mismatch(size, num_bytes)}"
    with lake.fs.open(full, "rb") as handle:
        digest = sha256_of(handle)
    if digest != checksum:
        return "checksum", f"its media file has {sha256_mismatch(digest, checksum)}"
    return "ok", ""


def _chunk_problem(lake: Lake, row: Any) -> tuple[str, str]:
    found = _problem(lake, row.path, int(row.num_bytes), row.checksum, int(row.num_docs))
    if found[0] == "ok" and isinstance(row.media_checksum, str):
        return _media_problem(lake, row.path, int(row.media_bytes), row.media_checksum)
    return found


def verify_lake(target: Config | str | os.PathLike[str], progress: bool = True) -> pd.DataFrame:
    """One row per committed chunk: ``status`` is ok, missing, size, checksum, unreadable or rows
    (of its chunk file, or of its media file, the detail says which)."""
    lake = open_lake(target)
    chunks = lake.sql(query("committed_chunk_files"))
    findings = [
        _chunk_problem(lake, row)
        for row in tqdm(chunks.itertuples(), total=len(chunks), unit="chunk", desc="verify", disable=not progress)
    ]
    chunks["status"] = [status for status, _ in findings]
    chunks["detail"] = [detail for _, detail in findings]
    return chunks[["dataset", "global_index", "path", "status", "detail"]]
