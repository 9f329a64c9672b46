"""A dataset's plan: its shards, its chunks in global order and its fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from lakeloader.config import Config, DatasetConfig
from lakeloader.contracts.errors import ConfigError, SourceError
from lakeloader.contracts.formats import RecordFormat
from lakeloader.contracts.selection import normalized_where, where_problem
from lakeloader.images import DECODER
from lakeloader.plan.metadata import infer_metadata_types
from lakeloader.plan.order import round_robin_order
from lakeloader.plan.sources import MissingSource, Shard, expand_sources, readable_url
from lakeloader.plan.splits import Split, plan_splits
from lakeloader.storage import is_transient

log = logging.getLogger(__name__)

# Bump when the chunk file layout changes: old chunks then never mix with new ones.
CHUNK_FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class DatasetPlan:
    """Everything known about a dataset before tokenizing anything."""

    name: str
    fingerprint: str
    format: str
    fields: tuple[str, ...]   # name of each part kind the chunks store (RecordFormat.kind_names)
    shards: list[Shard]
    chunks: pd.DataFrame  # one row per chunk in global order: see chunk_table()
    missing: list[MissingSource]
    settings_fingerprint: str = ""   # settings_fingerprint(): names the chunk folder
    metadata: tuple[tuple[str, str], ...] = ()   # each metadata field and its type (listed, or inferred)
    encoder: str = ""   # what encodes the documents, with its version (tokenizer.encoder_name)
    source: str | None = None   # a dataset defined by a filter: its source dataset (whose chunks it uses)
    where: str | None = None    # and its predicate
    extends: tuple[str, int] | None = None   # a grown plan (plan/growth.py): the plan it extends, its chunks

    @property
    def chunk_dir(self) -> str:
        """Folder (relative to the lake root) of this dataset's chunk files (a filtered dataset's
        are its source's)."""
        return chunk_folder(self.source or self.name, self.settings_fingerprint or self.fingerprint)


def chunk_folder(name: str, fingerprint: str) -> str:
    """Folder of a dataset's chunk files: named by the fingerprint of its settings, so chunks of
    other tokenizers, encoders, formats or split sizes never mix."""
    return f"{name}/{fingerprint[:16]}"


def _settings(dataset: DatasetConfig, tokenizer_fingerprint: str, split_size: int, encoder: str,
              metadata: dict[str, str] | None = None) -> dict[str, Any]:
    # The encoder's name and version are in: two encoders' ids never mix in one dataset, and
    # upgrading the encoder (or switching tokenizer_backend) re-tokenizes the dataset.
    settings = {
        "chunk_format": CHUNK_FORMAT_VERSION,
        "tokenizer": tokenizer_fingerprint,
        "encoder": encoder,
        "format": dataset.format,
        "fields": dataset.build_fields,
        "split_size": split_size,
    }
    if dataset.build_fields.get("images") == "stored":
        settings["decoder"] = DECODER   # what checked the stored images and measured their sizes
    metadata = dataset.metadata_fields if metadata is None else metadata
    if metadata:  # only then: the fingerprints of datasets without metadata stay as they were
        settings["metadata"] = list(metadata.items())
    return settings


def _hash(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def dataset_fingerprint(
    dataset: DatasetConfig, shards: list[Shard], tokenizer_fingerprint: str, split_size: int, encoder: str = "",
    metadata: dict[str, str] | None = None,
) -> str:
    """Hash of everything that changes the dataset's tokens, chunk boundaries or stored metadata
    (``encoder``: the encoder's name and version; ``metadata``: the planned types of its metadata
    fields, when some were inferred)."""
    return _hash({**_settings(dataset, tokenizer_fingerprint, split_size, encoder, metadata),
                  "sources": [(s.url, s.size, s.version) for s in shards]})


def settings_fingerprint(dataset: DatasetConfig, tokenizer_fingerprint: str, split_size: int,
                         encoder: str = "", metadata: dict[str, str] | None = None) -> str:
    """Hash of what changes every chunk's tokens, boundaries or stored metadata, whichever files
    the dataset has."""
    return _hash(_settings(dataset, tokenizer_fingerprint, split_size, encoder, metadata))


def definition_fingerprint(name: str, config: Config) -> str:
    """Hash of what ``config`` writes to define dataset ``name`` (built from sources): its source
    globs or URLs as resolved, format, fields, metadata fields as listed, tokenizer and split size.
    The plan a build makes of it (:func:`dataset_fingerprint`: the files those globs matched then,
    the tokenizer's contents, the encoder) is recorded against it in the catalog, so a reader
    knows whether the lake's plan of ``name`` is this config's (``catalog/identity.py``)."""
    dataset = config.datasets[name]
    return _hash({"chunk_format": CHUNK_FORMAT_VERSION, "tokenizer": config.tokenizer, "format": dataset.format,
                  "fields": dataset.build_fields, "split_size": config.build.split_size,
                  "metadata": list(dataset.metadata_fields.items()), "sources": list(dataset.sources)})


def shard_fingerprint(shard: Shard) -> str:
    """Hash of one file's identity (URL, size, version): names its chunk files, so the chunks of
    a file that did not change keep their names when other files of the dataset come or go."""
    return _hash([shard.url, shard.size, shard.version])


def chunk_table(splits: list[list[Split]], folder: str, shard_keys: list[str]) -> pd.DataFrame:
    """One row per chunk in global (round-robin) order with its split and file path.

    A chunk file is named by its folder, its shard's ``shard_keys`` entry and its split index:
    the same split of the same file under the same settings always has the same path.
    """
    shard_index, split_index = round_robin_order(np.array([len(s) for s in splits], dtype=np.int64))
    rows = [splits[k][r] for k, r in zip(shard_index.tolist(), split_index.tolist())]
    return pd.DataFrame(
        {
            "global_index": np.arange(len(rows), dtype=np.int64),
            "shard_index": shard_index,
            "split_index": split_index,
            "path": [f"{folder}/{shard_keys[k][:16]}-{r:06d}.parquet"
                     for k, r in zip(shard_index.tolist(), split_index.tolist())],
            "split_kind": [s.kind for s in rows],
            "split_start": np.array([s.start for s in rows], dtype=np.int64),
            "split_stop": np.array([s.stop for s in rows], dtype=np.int64),
            "first_row": np.array([s.first_row for s in rows], dtype=np.int64),
        }
    )


def _listing(lines: list[str], limit: int = 5) -> str:
    """The first ``limit`` of ``lines`` indented, one a line, and how many more there are."""
    listing = "\n".join(f"  {line}" for line in lines[:limit])
    return listing + (f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else "")


def _unreadable(name: str, missing: list[MissingSource]) -> SourceError:
    """The error for sources of dataset ``name`` that cannot be read under ``on_error: raise``."""
    return SourceError(
        f"dataset {name!r}: {len(missing)} source(s) cannot be read:\n"
        + "\n".join(f"  {m.source}: {m.reason}" for m in missing)
        + f"\nfix the paths under datasets.{name}.sources (or the files), or set datasets.{name}.on_error: skip "
        "to record them as rejects"
    )


def _check_layouts(name: str, dataset: DatasetConfig, record_format: RecordFormat, shards: list[Shard]) -> None:
    """ConfigError for plain-text sources of a format whose documents are more than one string,
    or of a dataset with metadata fields (a line of text has no fields)."""
    tars = [readable_url(shard.url) for shard in shards if shard.layout == "tar"]
    if tars and not record_format.stores_images:
        raise ConfigError(
            f"dataset {name!r}: WebDataset tar sources hold images, read only by format: interleaved with "
            f"interleaved.images: stored, but {len(tars)} source(s) are tars:\n{_listing(tars)}\n"
            f"set datasets.{name}.format: interleaved and datasets.{name}.interleaved.images: stored")
    plain = [readable_url(shard.url) for shard in shards if shard.layout == "text"]
    if plain and dataset.metadata_fields:
        raise ConfigError(
            f"dataset {name!r}: metadata_fields needs JSON Lines or Parquet sources (a line of plain text has "
            f"no fields), but {len(plain)} source(s) are plain text:\n{_listing(plain)}\n"
            f"remove datasets.{name}.metadata_fields or those sources"
        )
    if plain and not record_format.text_only:
        raise ConfigError(
            f"dataset {name!r}: format: {dataset.format} needs JSON Lines or Parquet sources "
            f"(.jsonl, .jsonl.gz, .jsonl.zst, .parquet), but {len(plain)} source(s) are plain text:\n"
            f"{_listing(plain)}\n"
            f"convert them or remove them from datasets.{name}.sources"
        )


def plan_dataset(
    name: str, config: Config, tokenizer_fingerprint: str, storage_options: dict[str, Any] | None = None,
    encoder: str = "",
) -> DatasetPlan:
    """Plan dataset ``name`` of ``config`` for the tokenizer with ``tokenizer_fingerprint`` encoded
    by ``encoder`` (name and version, see :func:`lakeloader.tokenizer.encoder_name`).

    Missing or unreadable sources (Parquet files whose footer cannot be read or whose text
    column holds no strings included) raise :class:`SourceError` before any work starts, unless
    the dataset has ``on_error: skip``; then they are returned in ``missing`` (they become
    rejects). A dataset whose readable files are all empty raises :class:`SourceError` either way.
    """
    dataset = config.datasets[name]
    options = config.storage_options if storage_options is None else storage_options
    shards, missing = expand_sources(dataset.sources, options)
    if missing and dataset.on_error == "raise":
        raise _unreadable(name, missing)
    record_format = dataset.record_format()
    _check_layouts(name, dataset, record_format, shards)
    split_size = config.build.split_size
    splits, readable = [], []
    for shard in shards:
        try:
            splits.append(plan_splits(shard, split_size, options, record_format))
            readable.append(shard)
        except Exception as exc:
            if is_transient(exc) or not isinstance(exc, (SourceError, OSError, pa.ArrowException)):
                raise
            url = readable_url(shard.url)
            reason = str(exc).removeprefix(f"{url}: ")
            if not isinstance(exc, SourceError):
                reason = f"cannot read: {type(exc).__name__}: {reason}"
            missing.append(MissingSource(url, reason))
    if missing and dataset.on_error == "raise":
        raise _unreadable(name, missing)
    for m in missing:
        log.warning("dataset %r: skipping source %s: %s", name, m.source, m.reason)
    if not readable:
        raise SourceError(f"dataset {name!r}: no readable source files in {dataset.sources}")
    if not any(splits):
        raise SourceError(
            f"dataset {name!r} has no documents: its {len(readable)} readable source file(s) are empty:\n"
            f"{_listing([readable_url(shard.url) for shard in readable])}\n"
            f"add non-empty sources to datasets.{name}.sources or remove the dataset"
        )
    metadata = dataset.metadata_fields
    if any(kind is None for kind in metadata.values()):
        metadata = infer_metadata_types(name, metadata, readable[0], options)  # chunk 0's file
    fingerprint = dataset_fingerprint(dataset, readable, tokenizer_fingerprint, split_size, encoder, metadata)
    settings = settings_fingerprint(dataset, tokenizer_fingerprint, split_size, encoder, metadata)
    return DatasetPlan(
        name=name,
        fingerprint=fingerprint,
        format=dataset.format,
        fields=record_format.kind_names,
        shards=readable,
        chunks=chunk_table(splits, chunk_folder(name, settings), [shard_fingerprint(s) for s in readable]),
        missing=missing,
        settings_fingerprint=settings,
        metadata=tuple(metadata.items()),
        encoder=encoder,
    )


def filtered_plan(name: str, config: Config, source: DatasetPlan) -> DatasetPlan:
    """The plan of dataset ``name`` defined by a filter of ``source``'s plan: the source's chunks
    (same files, same global order), and a fingerprint of the source's and of the normalized
    predicate, so a changed predicate or source is a new plan. A ConfigError if the predicate does
    not bind to the metadata types the source's plan fixed (inferred ones included)."""
    where = config.datasets[name].where or ""
    problem = where_problem(where, dict(source.metadata))
    if problem is not None:
        raise ConfigError(f"{config.source_file or 'config'}: datasets.{name}.where: {problem} (the metadata "
                          f"types of dataset {source.name!r} as planned: {dict(source.metadata)})")
    # A filter of a grown source grows with it: its chunks are its source's, in the same order.
    extends = None if source.extends is None else (filter_fingerprint(source.extends[0], where), source.extends[1])
    return dataclasses.replace(source, name=name, fingerprint=filter_fingerprint(source.fingerprint, where),
                               missing=[], source=source.name, where=where, extends=extends)


def filter_fingerprint(source_fingerprint: str, where: str) -> str:
    """The fingerprint of the plan selecting ``where`` from the plan ``source_fingerprint``: equal
    for predicates DuckDB prints back alike, different for any other source or predicate."""
    return _hash({"filter_of": source_fingerprint, "where": normalized_where(where)})


def with_planned_metadata(config: Config, plans: list[DatasetPlan]) -> Config:
    """``config`` with each planned dataset's metadata fields typed as its plan fixed them (types
    inferred at planning included): what the build's record formats use."""
    datasets = {plan.name: config.datasets[plan.name].model_copy(update={"metadata_fields": dict(plan.metadata)})
                for plan in plans if dict(plan.metadata) != config.datasets[plan.name].metadata_fields}
    datasets.update({name: dataset.model_copy(update={"metadata_fields": datasets[dataset.from_].metadata_fields})
                     for name, dataset in config.datasets.items() if dataset.from_ in datasets})
    if not datasets:
        return config
    return config.model_copy(update={"datasets": {**config.datasets, **datasets}})
