"""Checking every committed chunk of a lake, and every documents index file, against its catalog record."""

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


def _file_problem(lake: Lake, path: str, num_bytes: int, checksum: str, what: str | None = None,
                  num_docs: int | None = None) -> tuple[str, str]:
    """What is wrong with the file at ``path`` against its recorded size and sha256 (and, with
    ``num_docs``, the document count of its Parquet footer), if anything; ``what`` names it in the
    detail (None: a chunk file, whose row names it)."""
    full = lake.path_of(path)
    try:
        size = lake.fs.size(full)
    except FileNotFoundError:
        return "missing", f"{what or 'the file'} does not exist"
    if size != num_bytes:
        return "size", _detail(what, size_mismatch(size, num_bytes))
    with lake.fs.open(full, "rb") as handle:
        digest = sha256_of(handle)
        if digest != checksum:
            return "checksum", _detail(what, sha256_mismatch(digest, checksum))
        if num_docs is None:
            return "ok", ""
        try:
            handle.seek(0)
            rows = pq.ParquetFile(handle).metadata.num_rows
        except Exception as exc:  # reported as a finding, not raised: verify lists every problem
            return "unreadable", _detail(what, f"{type(exc).__name__}: {exc}")
    if rows != num_docs:
        return "rows", _detail(what, f"{rows} documents, the catalog says {num_docs}")
    return "ok", ""


def _detail(what: str | None, problem: str) -> str:
    return problem if what is None else f"{what} has {problem}"


def _chunk_problem(lake: Lake, row: Any) -> tuple[str, str]:
    """What is wrong with the chunk file of ``row`` (a committed_chunk_files row) or the media file
    it reads its images from (the one a build's end rewrote, else its own), if anything."""
    found = _file_problem(lake, row.path, int(row.num_bytes), row.checksum, num_docs=int(row.num_docs))
    if found[0] != "ok":
        return found
    if isinstance(row.deduped_checksum, str):
        return _file_problem(lake, row.deduped_path, int(row.deduped_bytes), row.deduped_checksum,
                             f"its media file {row.deduped_path}")
    if isinstance(row.media_checksum, str):
        path = media_path(row.path)
        return _file_problem(lake, path, int(row.media_bytes), row.media_checksum, f"its media file {path}")
    return found


def verify_lake(target: Config | str | os.PathLike[str], progress: bool = True) -> pd.DataFrame:
    """One row per committed chunk: ``status`` is ok, missing, size, checksum, unreadable or rows
    (of its chunk file, or of its media file, the detail says which); then one row per documents
    index file (``global_index`` -1): ok, missing, size or checksum."""
    lake = open_lake(target)
    chunks = lake.sql(query("committed_chunk_files"))
    con = lake.connect()
    try:
        indexed = con.execute(query("has_document_index")).fetchone()[0]
        index = con.execute(query("document_index_records")).df() if indexed else None
    finally:
        con.close()
    total = len(chunks) + (0 if index is None else len(index))
    with tqdm(total=total, unit="file", desc="verify", disable=not progress) as bar:
        findings = []
        for row in chunks.itertuples():
            findings.append(_chunk_problem(lake, row))
            bar.update()
        chunks["status"] = [status for status, _ in findings]
        chunks["detail"] = [detail for _, detail in findings]
        report = chunks[["dataset", "global_index", "path", "status", "detail"]]
        if index is None or index.empty:
            return report
        found = []
        for row in index.itertuples():
            found.append(_file_problem(lake, row.path, int(row.num_bytes), row.checksum, "the documents index file"))
            bar.update()
    index["global_index"] = -1
    index["status"] = [status for status, _ in found]
    index["detail"] = [detail for _, detail in found]
    return pd.concat([report, index[report.columns]], ignore_index=True)
