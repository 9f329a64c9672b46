"""Provenance of batch rows: dataset, epoch, chunk, shard, source document and token range."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from lakeloader.contracts.chunk_file import RECORD_COLUMN, open_chunk, unreadable_chunk
from lakeloader.feed.rows import StepExamples
from lakeloader.read.catalog_view import CatalogView, FetchOne


def _records(view: CatalogView, dataset: str, chunk: int) -> tuple[np.ndarray, dict[str, object]]:
    """Each document's record index within its split, and where the split starts in its source.
    A dataset defined by a filter: its documents' (the selected ones'), with ``documents`` their
    index in the file (the source dataset's document)."""
    lake = view.lake
    path, split_index, source, _layout, kind, first_row, before, committed_before = view.named(
        "chunk_records", {"name": dataset, "global_index": chunk}, FetchOne)
    with lake.fs.open(lake.path_of(path), "rb") as handle:
        try:
            records = open_chunk(handle).read(columns=[RECORD_COLUMN]).column(0).to_numpy()
        except (OSError, pa.ArrowException) as exc:
            raise unreadable_chunk(f"chunk {chunk} of dataset {dataset!r} ({lake.url_of(path)})",
                                   exc) from exc
    documents = None
    if view.is_filtered(dataset):
        documents = view.chunk_selection(dataset, chunk)
        records = records[documents]
    if kind == "row_group":
        base, unit = first_row, "row"
    elif kind == "file" or split_index == 0:
        base, unit = 1, "line"
    elif committed_before == split_index:
        base, unit = 1 + int(before or 0), "line"
    else:
        base, unit = None, "line"  # earlier splits of the shard are not built yet
    return records, {"source": source, "base": base, "unit": unit, "path": path, "documents": documents}


def _location(source: dict[str, object], records: np.ndarray, doc: int) -> str:
    base = source["base"]
    record = int(records[doc]) if doc < len(records) else None
    if base is not None and record is not None:
        return f"{source['unit']} {int(base) + record}"  # type: ignore[call-overload]
    return f"record {record} of split"


def explain(found: StepExamples, view: CatalogView) -> pd.DataFrame:
    """One row per (batch row, segment) of the examples of a step (``Loader.examples``): which
    dataset, epoch, chunk, shard, source document (file and line/row) and token range fed it;
    ``view`` is the catalog the examples were read from. ``document`` is the document's index in
    its dataset's chunk, ``source_document`` its index in the chunk file (they differ for a
    dataset defined by a filter, whose chunk holds the selected documents of its source's file).
    Interleaved datasets add ``images``, the images each segment places."""
    rows = []
    cache: dict[tuple[str, int], tuple[np.ndarray, dict[str, object]]] = {}
    for global_row, dataset_id, example in zip(found.rows.tolist(), found.dataset_ids.tolist(), found.examples):
        if example is None:
            rows.append({"step": found.step, "row": global_row, "dataset": None, "dataset_id": dataset_id,
                         "segment": 0})
            continue
        for segment in example.segments():
            key = (example.dataset, segment.chunk)
            if key not in cache:
                cache[key] = _records(view, *key)
            records, source = cache[key]
            rows.append({
                "step": found.step, "row": global_row, "dataset": example.dataset,
                "dataset_id": dataset_id, "epoch": example.epoch,
                "example": example.example, "segment": segment.number,
                "shard": int(found.shards[example.dataset][segment.chunk]), "chunk": segment.chunk,
                "chunk_path": source["path"], "document": segment.document,
                "source_document": segment.document if source["documents"] is None
                else int(source["documents"][segment.document]),   # type: ignore[index]
                "source": source["source"],
                "location": _location(source, records, segment.document),
                "example_start": segment.example_start, "example_stop": segment.example_stop, **segment.span,
            })
    frame = pd.DataFrame(rows)
    if "images" in frame:   # segments of interleaved documents: how many images each places
        frame["images"] = frame["images"].fillna(0).astype(np.int64)
    return frame
