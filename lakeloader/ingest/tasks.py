"""Choosing a build's chunk tasks: the uncommitted chunks, the committed ones to repair (file
missing, wrong size, or named by ``verify``), and the committed ones still lacking packing counts."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
from collections.abc import Collection, Iterator
from typing import Any

import pandas as pd

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.snapshot import SNAPSHOT_DIR
from lakeloader.catalog.stale import index_folder
from lakeloader.catalog.store import CatalogWriter
from lakeloader.config import Config
from lakeloader.contracts.media import media_path
from lakeloader.contracts.specs import PackingSpec
from lakeloader.ingest.chunk import ChunkTask
from lakeloader.ingest.document_index import DocumentIndexWriter
from lakeloader.ingest.documents import SplitSource
from lakeloader.plan.selection import SelectionTask
from lakeloader.plan.sources import url_from_bytes
from lakeloader.plan.splits import Split

log = logging.getLogger(__name__)

# Pending chunks read from the catalog at a time as their tasks are submitted: the driver holds no
# row per chunk of the lake (~450 bytes each as a DataFrame: ~0.5 GB at a million chunks).
PAGE_ROWS = 4096


@dataclasses.dataclass(frozen=True)
class PendingChunks:
    """The chunks a build run tokenizes (``len``: how many), read from the writer catalog a page of
    ``page_rows`` at a time: the uncommitted chunks of ``datasets`` by global index (datasets
    interleaved in their order), and the committed ones to rebuild (``repairs``, rows of
    :meth:`CatalogWriter.committed_chunks`) merged in by global index. A chunk committed after the
    page that holds it was read is not left out: pages follow the last chunk read, and only chunks
    read (submitted) commit."""

    writer: CatalogWriter
    datasets: list[str]
    count: int
    repairs: pd.DataFrame
    page_rows: int = PAGE_ROWS

    def __len__(self) -> int:
        return self.count

    def rows(self) -> Iterator[Any]:
        """The chunks' rows (columns of :meth:`CatalogWriter.pending_chunks`), ``len`` of them."""
        after, done, left = (-1, 0), -1, self.count
        while left > 0:
            page = self.writer.pending_chunks(self.datasets, after, self.page_rows)
            last = len(page) < self.page_rows
            upto = float("inf") if last else int(page.global_index.iloc[-1])
            repairs = self.repairs
            if len(repairs):
                repairs = repairs[(repairs.global_index > done) & (repairs.global_index <= upto)]
            if len(repairs):
                page = pd.concat([page, repairs[page.columns]]).sort_values("global_index", kind="stable")
            for row in page.head(left).itertuples(index=False):
                yield row
            left -= len(page)
            if last:
                return
            after = (int(page.global_index.iloc[-1]), self.datasets.index(page.dataset.iloc[-1]) + 1)
            done = upto


@dataclasses.dataclass(frozen=True)
class TaskBatch:
    """The work of one build run.

    ``pending``: chunks to tokenize, by global index (uncommitted ones and repairs), read from the
    catalog as their tasks are submitted. ``repairs``: ``(dataset, global_index)`` of
    each committed chunk rebuilt -> the checksum its new file must have. ``unplanned``: per
    dataset, committed chunks (not rebuilt) whose counts under ``packing`` are missing.
    ``total``: planned chunks of ``names``. ``selections``: chunks of datasets defined by a filter
    to evaluate now (their source chunk is committed; uncommitted ones, and committed ones lacking
    packing counts), with the columns of :meth:`CatalogWriter.pending_selections`; ``filters``:
    per source dataset, the datasets defined by a filter of it (evaluated as its chunks commit).
    """

    names: list[str]
    packing: dict[str, PackingSpec]
    pending: PendingChunks
    repairs: dict[tuple[str, int], str]
    unplanned: dict[str, pd.DataFrame]
    total: int
    selections: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    filters: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def has_work(self) -> bool:
        """Whether any chunk is to be tokenized, counted or selected."""
        return bool(len(self.pending) or len(self.selections) or any(len(rows) for rows in self.unplanned.values()))

    def selection_tasks(self, config: Config, lake: Lake, rows: pd.DataFrame) -> list[SelectionTask]:
        """The task of each chunk of a filtered dataset in ``rows`` (columns of
        :meth:`CatalogWriter.pending_selections`)."""
        return [SelectionTask(
            dataset=row.dataset, source=row.source_dataset, global_index=int(row.global_index), where=row.where,
            chunk_url=lake.url_of(row.path), num_bytes=int(row.num_bytes), checksum=row.checksum,
            num_records=int(row.num_records), kinds=len(config.datasets[row.dataset].part_kinds),
            storage_options=config.storage_options,
            packing=(self.packing[row.dataset],) if row.dataset in self.packing else (),
            source_file=row.source, line_base=None if pd.isna(row.line_base) else int(row.line_base),
        ) for row in rows.itertuples(index=False)]

    def chunk_tasks(self, config: Config, lake: Lake, tokenizer_url: str) -> Iterator[ChunkTask]:
        """The task of each pending chunk, in ``pending``'s order."""
        formats = {name: dataset.record_format() for name, dataset in config.datasets.items()}
        for row in self.pending.rows():
            dataset = config.datasets[row.dataset]
            yield ChunkTask(
                dataset=row.dataset,
                global_index=int(row.global_index),
                source=SplitSource(
                    url=url_from_bytes(row.source_raw) if isinstance(row.source_raw, (bytes, bytearray)) else row.source,
                    layout=row.layout,
                    compression=row.compression if isinstance(row.compression, str) else None,
                    split=Split(row.split_kind, int(row.split_start), int(row.split_stop), int(row.first_row)),
                    record_format=formats[row.dataset],
                    on_error=dataset.on_error,
                    storage_options=config.storage_options,
                ),
                chunk_url=lake.url_of(row.path),
                tokenizer_url=tokenizer_url,
            encoder=row.encoder,
                row_group_tokens=config.build.row_group_tokens,
                io_retry_deadline=config.io_retry_deadline,
                packing=(self.packing[row.dataset],) if row.dataset in self.packing else (),
                repair_checksum=self.repairs.get((row.dataset, int(row.global_index))),
            )


def choose_tasks(config: Config, lake: Lake, writer: CatalogWriter, packing: dict[str, PackingSpec],
                 requested: Collection[tuple[str, int]]) -> TaskBatch:
    """The work of a build of ``config``'s datasets, after removing the temporary files a killed
    build left. ``requested`` are ``(dataset, global_index)`` pairs to rebuild (e.g. what
    ``verify`` found corrupt); committed chunks whose file is missing or of the wrong size are
    rebuilt too."""
    filtered = [name for name, dataset in config.datasets.items() if dataset.from_ is not None]
    names = [name for name in config.datasets if name not in filtered]   # the datasets tokenized
    unplanned = {name: writer.chunks_without_plan(name, spec.plan_key) for name, spec in packing.items()
                 if name not in filtered}
    selections = writer.pending_selections(filtered)
    for name in filtered:   # committed, but counted under another packing plan: evaluated again
        if name in packing:
            again = writer.pending_selections([name], committed=True)
            lacking = writer.chunks_without_plan(name, packing[name].plan_key).global_index
            selections = pd.concat([selections, again[again.global_index.isin(lacking)]])
    filters: dict[str, list[str]] = {}
    for name in filtered:
        filters.setdefault(config.datasets[name].from_ or "", []).append(name)
    folders = writer.chunk_folders(names)
    _remove_partial_files(lake, [SNAPSHOT_DIR, *folders, *(index_folder(name) for name in names)])
    repairs = _chunks_to_repair(lake, writer, names, folders, requested)
    DocumentIndexWriter(lake, writer).drop_missing(names)
    expected = {(row.dataset, int(row.global_index)): row.checksum for row in repairs.itertuples(index=False)}
    pending = PendingChunks(writer, names, writer.pending_chunk_count(names) + len(repairs), repairs, PAGE_ROWS)
    if len(repairs):  # their packing counts come with the rebuilt chunks, not from their files
        unplanned = {name: rows[~rows.global_index.isin(repairs.global_index[repairs.dataset == name])]
                     for name, rows in unplanned.items()}
    total = writer.chunk_count(names)
    log.info("%d of %d chunks to build%s", len(pending), total,
             f" ({len(repairs)} committed ones to repair)" if len(repairs) else "")
    if filtered:
        log.info("%d chunk selections of %d filtered dataset(s) to evaluate now", len(selections), len(filtered))
    return TaskBatch(names + filtered, packing, pending, expected, unplanned, total,
                     selections.sort_values("global_index", kind="stable") if len(selections) else selections, filters)


def _chunks_to_repair(lake: Lake, writer: CatalogWriter, names: list[str], folders: list[str],
                      requested: Collection[tuple[str, int]]) -> pd.DataFrame:
    """Committed chunks whose file or media file is missing or not the size the catalog records (found by
    listing each of the datasets' chunk ``folders``, not by reading the files), plus those in
    ``requested``. A media file a build's end rewrote that is missing, of the wrong size or of a
    requested chunk is forgotten (the chunk's own media file is checked instead; this build's end
    writes it again)."""
    committed = writer.committed_chunks(names)
    if committed.empty:
        return committed
    sizes: dict[str, int] = {}
    for folder in folders:
        sizes.update(lake.file_sizes(folder, "the chunk folder"))
    wanted = set(requested)
    rows = []
    lost: dict[str, list[int]] = {}
    for row in committed.itertuples(index=False):
        size = sizes.get(row.path)
        has_media = isinstance(row.media_checksum, str)
        deduped = isinstance(row.deduped_checksum, str)
        if deduped and (sizes.get(row.deduped_path) != row.deduped_bytes or (row.dataset, int(row.global_index)) in wanted):
            # Forgotten, and rewritten at the build's end; until then the chunk reads its own media
            # file, which is checked below (gc may have removed it).
            lost.setdefault(row.dataset, []).append(int(row.global_index))
            deduped = False
        has_media = has_media and not deduped   # (a rewritten one's own media file is not read)
        media = sizes.get(media_path(row.path)) if has_media else None
        if size is None:
            problem = "its file is missing"
        elif size != row.num_bytes:
            problem = f"its file has {size} bytes, the catalog says {row.num_bytes}"
        elif has_media and media is None:
            problem = "its media file (its images) is missing"
        elif has_media and media != row.media_bytes:
            problem = f"its media file has {media} bytes, the catalog says {int(row.media_bytes)}"
        elif (row.dataset, int(row.global_index)) in wanted:
            problem = "verify found it damaged"
        else:
            continue
        log.warning("chunk %d of dataset %r (%s): %s; rebuilding it", row.global_index, row.dataset,
                    lake.url_of(row.path), problem)
        rows.append(row)
    for dataset, indices in lost.items():
        log.warning("dataset %r: %d rewritten media file(s) missing, damaged or to repair (chunk %d, say); "
                    "their chunks read their own media files until this build's end rewrites them", dataset,
                    len(indices), indices[0])
        writer.forget_media_files(dataset, indices)
    return pd.DataFrame(rows, columns=committed.columns)


def _remove_partial_files(lake: Lake, folders: list[str]) -> None:
    """Delete temporary files a killed build left behind (safe: this build holds the lock)."""
    if not lake.is_local:
        return  # object stores write chunks in one PUT: nothing partial is ever visible
    for folder in folders:
        for leftover in glob.glob(os.path.join(lake.path_of(folder), "*.tmp-*")):
            os.remove(leftover)
            log.info("removed %s left by an interrupted build", leftover)
