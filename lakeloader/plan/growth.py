"""Append-only growth of a dataset's plan: when the files of a dataset are its built plan's files,
unchanged, plus new ones, the grown plan keeps every chunk of the built plan at its global index
and appends the new files' chunks after them, round-robin over the new files by split index.

So a run that read the dataset can go on over it (``feed/run_state.py``): its examples so far are
the grown plan's first ones. The chunk order of a grown dataset therefore depends on its growth
steps: a fresh build of the same files (never seen the older plan) orders them round-robin over
all of them (:func:`~lakeloader.plan.planner.plan_dataset`), and the lake stays a pure function of
its build history. The grown plan's fingerprint hashes the older plan's and the added files, so it
never equals a fresh plan's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pandas as pd

from lakeloader.plan.planner import DatasetPlan, chunk_table, shard_fingerprint
from lakeloader.plan.sources import Shard
from lakeloader.plan.splits import Split

CHUNK_COLUMNS = ["global_index", "shard_index", "split_index", "path", "split_kind", "split_start", "split_stop",
                 "first_row"]


@dataclasses.dataclass(frozen=True)
class BuiltPlan:
    """What the catalog holds of a dataset's plan: its fingerprint, chunk folder, whether it is
    defined by a filter, its files (URL, size, version) in shard order, and its chunk rows
    (:data:`CHUNK_COLUMNS`) in global order."""

    fingerprint: str
    chunk_dir: str
    filtered: bool
    files: list[tuple[str, int, str]]
    chunks: pd.DataFrame


def grown_fingerprint(older: str, added: list[Shard]) -> str:
    """The fingerprint of plan ``older`` grown by the files ``added``."""
    payload = {"grows": older, "sources": [(s.url, s.size, s.version) for s in added]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _splits_by_shard(chunks: pd.DataFrame, shards: int) -> list[list[Split]]:
    """Each shard's splits in order, from a plan's chunk table."""
    splits: list[list[Split]] = [[] for _ in range(shards)]
    for row in chunks.sort_values(["shard_index", "split_index"]).itertuples(index=False):
        splits[int(row.shard_index)].append(Split(str(row.split_kind), int(row.split_start), int(row.split_stop),
                                                  int(row.first_row)))
    return splits


def grown_plan(fresh: DatasetPlan, built: BuiltPlan | None) -> DatasetPlan:
    """The plan to register for ``fresh`` (a plan of the dataset's files as they are now) over
    ``built`` (the lake's plan of the name): a growth of ``built`` when the files are its files,
    unchanged, plus new ones; ``built`` itself when they are its files (a grown plan stays in
    force); else ``fresh``: no built plan, a filter, other build settings (another chunk folder),
    or a built file changed or gone."""
    if (built is None or built.filtered or fresh.source is not None or built.fingerprint == fresh.fingerprint
            or built.chunk_dir != fresh.chunk_dir):
        return fresh
    position = {(s.url, s.size, s.version): k for k, s in enumerate(fresh.shards)}
    kept = [position.get(tuple(f)) for f in built.files]   # type: ignore[arg-type]
    if any(k is None for k in kept):
        return fresh
    old = set(kept)
    added = [k for k in range(len(fresh.shards)) if k not in old]
    shards = [fresh.shards[k] for k in kept] + [fresh.shards[k] for k in added]   # type: ignore[index]
    old_chunks = built.chunks[CHUNK_COLUMNS].astype(fresh.chunks[CHUNK_COLUMNS].dtypes.to_dict())
    if not added:
        return dataclasses.replace(fresh, fingerprint=built.fingerprint, shards=shards, chunks=old_chunks)
    splits = _splits_by_shard(fresh.chunks, len(fresh.shards))
    new = chunk_table([splits[k] for k in added], fresh.chunk_dir,
                      [shard_fingerprint(fresh.shards[k]) for k in added])
    new["global_index"] += len(old_chunks)
    new["shard_index"] += len(kept)
    chunks = pd.concat([old_chunks, new[CHUNK_COLUMNS]], ignore_index=True)
    return dataclasses.replace(fresh, fingerprint=grown_fingerprint(built.fingerprint, [fresh.shards[k] for k in added]),
                               shards=shards, chunks=chunks, extends=(built.fingerprint, len(old_chunks)))
