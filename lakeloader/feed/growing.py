"""A dataset's committed chunks while it may still be built: readers work on the committed
prefix and wait (with a timeout) only for a chunk that is not committed yet."""

from __future__ import annotations

from lakeloader.read.catalog_view import CatalogView, DatasetChunks


class GrowingChunks:
    """The committed prefix of dataset ``name`` (:attr:`chunks`), refreshed from the catalog
    only when more is needed. The parts that read the dataset (its order and its locator) read
    :attr:`chunks` each time and recompute what they derive from it when it is a new object."""

    def __init__(self, name: str, view: CatalogView, wait_timeout: float, plan_key: str | None,
                 part_counts: bool) -> None:
        """``plan_key``: the packing plan whose per-chunk example counts are read (pack | pad);
        ``part_counts``: whether rendered lengths need the parts of each kind (the template's)."""
        self.name = name
        self.view = view
        self.wait_timeout = wait_timeout
        self.plan_key = plan_key
        self.part_counts = part_counts
        self.chunks: DatasetChunks = view.dataset(name, plan_key, part_counts)

    @property
    def fingerprint(self) -> str:
        """Fingerprint of the dataset's plan (what defines its chunks)."""
        return self.chunks.fingerprint

    def wait(self) -> None:
        """Wait for the next chunk of the committed prefix (or for the dataset to be complete)."""
        if self.chunks.complete:
            raise AssertionError("complete datasets never wait")
        self.chunks = self.view.wait_for(self.name, self.chunks.committed, self.wait_timeout, self.plan_key,
                                         self.part_counts)

    def complete(self) -> DatasetChunks:
        """The dataset once every chunk is committed (waits for the build if needed)."""
        while not self.chunks.complete:
            self.chunks = self.view.wait_for(self.name, self.chunks.planned - 1, self.wait_timeout, self.plan_key,
                                             self.part_counts)
        return self.chunks
