"""The types of metadata fields listed without one (``metadata_fields: [lang, score]``), fixed at
planning from the dataset's first records, so that every chunk, built in parallel, stores a field
the same way and rejects the same values."""

from __future__ import annotations

import gzip
import io
from typing import Any

import orjson
import pyarrow.parquet as pq
import zstandard
from fsspec.core import url_to_fs

from lakeloader.contracts.chunk_file import metadata_kind_of
from lakeloader.contracts.errors import ConfigError
from lakeloader.contracts.formats import metadata_kind
from lakeloader.plan.sources import Shard, readable_url

# Records of the first file searched for a first value of each untyped field.
INFER_RECORDS = 10_000


def _first_lines(shard: Shard, storage_options: dict[str, Any]) -> list[bytes]:
    fs, path = url_to_fs(shard.url, **storage_options)
    lines: list[bytes] = []
    with fs.open(path, "rb") as raw:
        handle: Any = raw
        if shard.compression == "gzip":
            handle = gzip.GzipFile(fileobj=raw)
        elif shard.compression == "zstd":
            handle = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
        for line in handle:
            lines.append(line)
            if len(lines) >= INFER_RECORDS:
                break
    return lines


def infer_metadata_types(name: str, fields: dict[str, str | None], first: Shard,
                         storage_options: dict[str, Any]) -> dict[str, str]:
    """``fields`` with each missing type filled in: the type of the field's first non-null value
    in the first ``INFER_RECORDS`` records of ``first`` (the dataset's first file), or of its
    Parquet column. ConfigError, naming the key, for a field not found there."""
    missing = [field for field, kind in fields.items() if kind is None]
    found: dict[str, str] = {}
    if missing and first.layout == "parquet":
        fs, path = url_to_fs(first.url, **storage_options)
        with fs.open(path, "rb") as handle:
            schema = pq.read_schema(handle)
        for field in missing:
            kind = metadata_kind_of(schema.field(field).type) if field in schema.names else None
            if kind is not None:
                found[field] = kind
    elif missing:
        for line in _first_lines(first, storage_options):
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue   # the build rejects or raises on it
            if not isinstance(record, dict):
                continue
            for field in missing:
                if field not in found:
                    kind = metadata_kind(record.get(field))
                    if kind is not None:
                        found[field] = kind
            if len(found) == len(missing):
                break
    unknown = [field for field in missing if field not in found]
    if unknown:
        where = (f"its column in {readable_url(first.url)} is missing or not a string, number or boolean"
                 if first.layout == "parquet" else
                 f"no string, number or boolean value in the first {INFER_RECORDS:,} records of {readable_url(first.url)}")
        raise ConfigError(
            f"datasets.{name}.metadata_fields: cannot tell the type of {', '.join(map(repr, unknown))} ({where}): "
            f"give it, e.g. metadata_fields: {{{', '.join(f'{field}: string' for field in unknown)}}} "
            "(string | int | float | bool)")
    return {field: kind if kind is not None else found[field] for field, kind in fields.items()}
