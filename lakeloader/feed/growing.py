"""A dataset's committed chunks while it may still be built: readers work on the committed
prefix and wait (with a timeout) only for a chunk that is not committed yet."""

from __future__ import annotations

import numpy as np

from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.windows import StreamReader


class GrowingDataset:
    """The committed prefix of dataset ``name``, refreshed from the catalog when more is needed
    (subclasses derive their per-chunk offsets from it in ``_set``)."""

    plan_key: str | None = None   # packing plan whose per-chunk counts this reads (pack | pad)

    def __init__(self, name: str, view: CatalogView, reader: StreamReader, wait_timeout: float) -> None:
        self.name = name
        self.view = view
        self.reader = reader
        self.wait_timeout = wait_timeout
        self._set(view.dataset(name, self.plan_key, self.part_counts))

    def _set(self, chunks: DatasetChunks) -> None:
        self.chunks = chunks
        self.sequence = np.arange(chunks.committed)  # the global order: chunk c is the c-th

    def _wait(self) -> None:
        """Wait for the next chunk of the committed prefix (or for the dataset to be complete)."""
        if self.chunks.complete:
            raise AssertionError("complete datasets never wait")
        self._set(self.view.wait_for(self.name, self.chunks.committed, self.wait_timeout, self.plan_key,
                                     self.part_counts))

    @property
    def part_counts(self) -> bool:
        """Whether the dataset's rendered lengths need the parts of each kind (its template's)."""
        return self.reader.template.counts_parts

    @property
    def fingerprint(self) -> str:
        """Fingerprint of the dataset's plan (what defines its chunks)."""
        return self.chunks.fingerprint

    def complete_chunks(self) -> DatasetChunks:
        """The dataset once every chunk is committed (waits for the build if needed)."""
        while not self.chunks.complete:
            self._set(self.view.wait_for(self.name, self.chunks.planned - 1, self.wait_timeout, self.plan_key,
                                         self.part_counts))
        return self.chunks
