"""Progress counters (catalog/schema.sql ``dataset_progress``, ``shard_progress``, and
``plan_folders``, kept alike): what a commit adds to them, and the SQL counting them from the chunk
rows, which they always equal.

The writer keeps them in the transaction of every change of the chunk rows (``CatalogWriter``:
commits add a batch's sums, a new plan counts its dataset afresh, an open checks them all), so
that ``lakeloader status`` and the ``datasets`` and ``shards`` views read a row per dataset and per
shard, not every chunk.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lakeloader.catalog.sql import query
from lakeloader.contracts.chunk_file import ChunkResult

# Rows of chunks the writer reads at a time looking for where a dataset's committed prefix ends
# (doubled while it finds none uncommitted): a build commits near the prefix, so one read does.
PREFIX_WINDOW = 4096

_DATASET_SUMS = ("chunks", "num_docs", "num_tokens", "num_bytes", "source_bytes", "num_rejects")
_SHARD_SUMS = ("chunks", "num_docs", "num_tokens", "num_rejects")

# Each table of counters (and plan_folders, kept alike) and the statement counting its rows.
COUNTED = {"dataset_progress": "counted_dataset_progress", "shard_progress": "counted_shard_progress",
           "plan_folders": "counted_plan_folders"}


def counted() -> dict[str, str]:
    """The placeholders ``datasets``, ``shards`` and ``folders`` of the statements comparing or
    replacing the counters: their count from the chunk rows."""
    return {"datasets": query(COUNTED["dataset_progress"]), "shards": query(COUNTED["shard_progress"]),
            "folders": query(COUNTED["plan_folders"])}


def counted_views(stored: Iterable[str]) -> str:
    """For a reader of a catalog file storing the tables ``stored``: a view of each table of
    counters it lacks (written before them), their count from its chunk rows."""
    return "".join(query("counted_view").format(table=table, select=query(statement)) + ";"
                   for table, statement in COUNTED.items() if table not in stored)


def commit_sums(fresh: Sequence[ChunkResult], splits: Mapping[tuple[str, int], tuple[int, int]]
                ) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """What committing chunks ``fresh`` (committed by this commit, none before; ``splits``: each
    one's shard and split) adds to the counters: the parameters of count_committed_dataset for
    each dataset (but shards_done, known once count_committed_shards ran, and window), and those
    of count_committed_shards (one element per shard)."""
    datasets: dict[str, list[int]] = {}
    shards: dict[tuple[str, int], list[int]] = {}
    first: dict[str, int] = {}
    for r in fresh:
        rejects = len(r.rejects)
        first[r.dataset] = min(first.get(r.dataset, r.global_index), r.global_index)
        for total, values in ((datasets.setdefault(r.dataset, [0] * len(_DATASET_SUMS)),
                               (1, r.num_docs, r.num_tokens, r.num_bytes, r.source_bytes, rejects)),
                              (shards.setdefault((r.dataset, splits[(r.dataset, r.global_index)][0]),
                                                 [0] * len(_SHARD_SUMS)),
                               (1, r.num_docs, r.num_tokens, rejects))):
            for k, value in enumerate(values):
                total[k] += value
    per_dataset = [{"dataset": dataset, "first": first[dataset], **dict(zip(_DATASET_SUMS, sums))}
                   for dataset, sums in datasets.items()]
    per_shard = {"dataset": [d for d, _ in shards], "shard_index": [s for _, s in shards],
                 **{name: [sums[k] for sums in shards.values()] for k, name in enumerate(_SHARD_SUMS)}}
    return per_dataset, per_shard
