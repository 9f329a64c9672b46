"""Checking every committed chunk of a lake against its catalog record."""

from __future__ import annotations

import os

import pandas as pd
import pyarrow.parquet as pq
from tqdm import tqdm

from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.catalog.sql import query
from lakeloader.config import Config
from lakeloader.contracts.chunk_file import sha256_mismatch, size_mismatch
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


def verify_lake(target: Config | str | os.PathLike[str], progress: bool = True) -> pd.DataFrame:
    """One row per committed chunk: ``status`` is ok, missing, size, checksum, unreadable or rows."""
    lake = open_lake(target)
    chunks = lake.sql(query("committed_chunk_files"))
    findings = [
        _problem(lake, row.path, int(row.num_bytes), row.checksum, int(row.num_docs))
        for row in tqdm(chunks.itertuples(), total=len(chunks), unit="chunk", desc="verify", disable=not progress)
    ]
    chunks["status"] = [status for status, _ in findings]
    chunks["detail"] = [detail for _, detail in findings]
    return chunks[["dataset", "global_index", "path", "status", "detail"]]
