"""What a writer changed in its catalog since it last published: the keys of the chunks whose rows
changed, so that the next publish writes only those (catalog/delta.py) and not the whole catalog.

Tables fall in three kinds (catalog/schema.sql):

- keyed (``KEYED_TABLES``): rows of one chunk, keyed by (dataset, global_index) (a shard's
  counters, ``shard_progress``, by its first chunk); a delta carries every row of each chunk changed
  since the previous publish, replacing that chunk's rows;
- static (``STATIC_TABLES``): written only when a dataset is planned, which makes the next publish
  a full snapshot;
- whole: every other table, small whatever the lake's size (plans, builds, mixtures, lake_meta),
  carried whole in each delta.

A writer records the keys of the statements it knows (``KEYED_STATEMENTS``, ``WHOLE_STATEMENTS``,
``READ_STATEMENTS``); any other statement makes the change set unknown, and the next publish a full
snapshot: a statement added without being listed here costs time, never a wrong delta.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

KEYED_TABLES = ("chunks", "row_groups", "chunk_images", "selections", "chunk_examples", "rejects",
                "document_index_chunks", "media_files", "shard_progress")
STATIC_TABLES = ("shard_plans",)
# Statements that change keyed tables only for the chunks their caller records (CatalogWriter.commit,
# commit_plans).
KEYED_STATEMENTS = frozenset({
    "commit_chunk", "commit_batch_chunks", "commit_batch_row_groups", "commit_batch_images", "commit_batch_examples",
    "commit_batch_missing_examples", "commit_batch_selections", "commit_batch_rejects", "insert_chunk_examples",
    "insert_document_index_chunks", "move_document_index_chunks", "forget_document_index_chunks",
    "insert_media_files", "forget_media_files", "count_committed_shards", "count_committed_shard"})
# Statements that change whole tables only.
WHOLE_STATEMENTS = frozenset({
    "set_on_error", "record_definition", "insert_packing_plan", "touch_mixture", "insert_mixture",
    "insert_mixture_stage", "insert_mixture_node", "start_build", "set_build_cluster", "finish_build",
    "interrupt_stale_builds", "set_schema_version", "init_lake_id", "set_lake_meta",
    "insert_document_index_file", "drop_document_index_files", "count_committed_dataset", "set_committed_prefix"})
READ_STATEMENTS = frozenset({
    "begin_transaction", "commit_transaction", "rollback_transaction", "checkpoint", "writer_settings", "schema_version",
    "dataset_plan", "chunk_count", "pending_chunk_count", "chunk_folders", "chunk_tasks", "chunks_without_plan",
    "datasets_without_documents", "filtered_datasets", "pending_selections", "reader_dataset", "built_plan_files",
    "built_plan_chunks", "committed_among", "document_index_files_of_dataset", "document_index_chunks_of",
    "document_index_chunk_keys", "media_rewrites", "current_media_files", "progress_differs",
    "next_uncommitted"})


@dataclasses.dataclass
class ChangeLog:
    """The chunks a writer changed since its last publish, and what it published (for deciding
    whether the next publish may be a delta on the same base)."""

    keys: dict[str, set[int]] | None = None   # None: unknown (nothing published by this writer yet)
    published: int | None = None               # the version this writer last published
    base: int | None = None                    # the full snapshot that version adds its deltas to
    base_bytes: int = 0
    delta_bytes: int = 0                       # of the deltas published on that base
    publishes: int = 0                         # publishes begun by this writer (each may have landed)

    def statement(self, name: str) -> None:
        """Note that statement ``name`` of catalog/queries.sql ran: one not listed as keyed, whole
        or read-only makes the changes unknown."""
        if name not in KEYED_STATEMENTS and name not in WHOLE_STATEMENTS and name not in READ_STATEMENTS:
            self.keys = None

    def chunks(self, keys: Iterable[tuple[str, int]]) -> None:
        """Record that the rows of chunks ``keys`` (dataset, global_index) changed."""
        if self.keys is not None:
            for dataset, global_index in keys:
                self.keys.setdefault(dataset, set()).add(int(global_index))

    def take(self) -> dict[str, set[int]] | None:
        """The changes recorded so far, recording afresh from now on: a publish begins (one that
        fails calls :meth:`lost`)."""
        self.publishes += 1
        keys = self.keys
        if keys is not None:
            self.keys = {}
        return keys

    def lost(self) -> None:
        """A publish failed after :meth:`take`: the next one is a full snapshot."""
        self.keys = self.published = self.base = None

    def published_base(self, version: int, size: int) -> None:
        """Version ``version`` was published as a full snapshot of ``size`` bytes."""
        self.published, self.base, self.base_bytes, self.delta_bytes = version, version, size, 0
        if self.keys is None:
            self.keys = {}

    def published_delta(self, version: int, size: int) -> None:
        """Version ``version`` was published as a delta of ``size`` bytes."""
        self.published = version
        self.delta_bytes += size
