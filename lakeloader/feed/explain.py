"""Provenance of batch rows: dataset, epoch, chunk, shard, source document and token range."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa

from lakeloader.contracts.chunk_file import RECORD_COLUMN, open_chunk, unreadable_chunk
from lakeloader.feed.examples import PackedExample, Window

if TYPE_CHECKING:
    from lakeloader.feed.loader import Loader


def _records(loader: Loader, dataset: str, chunk: int) -> tuple[np.ndarray, dict[str, object]]:
    """Each document's record index within its split, and where the split starts in its source."""
    view = loader.view
    path, split_index, source, _layout, kind, first_row, before, committed_before = view.named(
        "chunk_records", {"name": dataset, "global_index": chunk}).fetchone()
    with loader.lake.fs.open(loader.lake.path_of(path), "rb") as handle:
        try:
            records = open_chunk(handle).read(columns=[RECORD_COLUMN]).column(0).to_numpy()
        except (OSError, pa.ArrowException) as exc:
            raise unreadable_chunk(f"chunk {chunk} of dataset {dataset!r} ({loader.lake.url_of(path)})",
                                   exc) from exc
    if kind == "row_group":
        base, unit = first_row, "row"
    elif kind == "file" or split_index == 0:
        base, unit = 1, "line"
    elif committed_before == split_index:
        base, unit = 1 + int(before or 0), "line"
    else:
        base, unit = None, "line"  # earlier splits of the shard are not built yet
    return records, {"source": source, "base": base, "unit": unit, "path": path}


def _location(source: dict[str, object], records: np.ndarray, doc: int) -> str:
    base = source["base"]
    record = int(records[doc]) if doc < len(records) else None
    if base is not None and record is not None:
        return f"{source['unit']} {int(base) + record}"  # type: ignore[call-overload]
    return f"record {record} of split"


def explain_windows(loader: Loader, step: int, windows: list[Window | PackedExample | None]) -> pd.DataFrame:
    """One row per (batch row, segment): where each segment's tokens came from."""
    rows = []
    cache: dict[tuple[str, int], tuple[np.ndarray, dict[str, object]]] = {}
    shard_of = {d.name: d.chunks.shard_index for d in loader.datasets}
    for row, window in enumerate(windows):
        global_row = int(loader.row_indices[row])
        if window is None:
            rows.append({"step": step, "row": global_row, "dataset": None, "segment": 0})
            continue
        if isinstance(window, PackedExample):
            offset = 0
            for segment, item in enumerate(window.items, start=1):
                key = (window.dataset, item.chunk)
                if key not in cache:
                    cache[key] = _records(loader, *key)
                records, source = cache[key]
                length = item.stop - item.start
                rows.append({
                    "step": step, "row": global_row, "dataset": window.dataset, "epoch": window.epoch,
                    "example": window.example, "segment": segment,
                    "shard": int(shard_of[window.dataset][item.chunk]), "chunk": item.chunk,
                    "chunk_path": source["path"], "document": item.doc, "source": source["source"],
                    "location": _location(source, records, item.doc),
                    "window_start": offset, "window_stop": offset + length,
                    "document_start": item.start, "document_stop": item.stop,
                })
                offset += length
            continue
        offset = 0
        segment = 0
        previous_key = None
        for piece in window.pieces:
            key = (window.dataset, piece.chunk)
            if key not in cache:
                cache[key] = _records(loader, *key)
            records, source = cache[key]
            doc_change = np.flatnonzero(np.diff(piece.docs, prepend=-1))
            bounds = np.append(doc_change, len(piece.docs))
            for a, b in zip(bounds[:-1], bounds[1:]):
                doc = int(piece.docs[a])
                doc_key = (piece.position, doc)
                if doc_key != previous_key:
                    segment += 1
                    previous_key = doc_key
                location = _location(source, records, doc)
                rows.append({
                    "step": step, "row": global_row, "dataset": window.dataset, "epoch": window.epoch,
                    "example": window.example, "segment": segment, "shard": int(shard_of[window.dataset][piece.chunk]),
                    "chunk": piece.chunk, "chunk_path": source["path"], "document": doc,
                    "source": source["source"], "location": location,
                    "window_start": offset + int(a), "window_stop": offset + int(b),
                    "chunk_stream_start": piece.start + int(a), "chunk_stream_stop": piece.start + int(b),
                })
            offset += len(piece.docs)
    return pd.DataFrame(rows)
