"""Expanding source patterns into shards: files with their size, version and layout."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from lakeloader.contracts.errors import SourceError
from lakeloader.storage import is_local

log = logging.getLogger(__name__)

_LAYOUTS = {
    ".jsonl": ("jsonl", None), ".ndjson": ("jsonl", None),
    ".jsonl.gz": ("jsonl", "gzip"), ".ndjson.gz": ("jsonl", "gzip"),
    ".jsonl.zst": ("jsonl", "zstd"), ".ndjson.zst": ("jsonl", "zstd"),
    ".txt": ("text", None), ".txt.gz": ("text", "gzip"), ".txt.zst": ("text", "zstd"),
    ".parquet": ("parquet", None),
    ".tar": ("tar", None), ".tar.gz": ("tar", "gzip"),   # WebDataset shards
}


@dataclasses.dataclass(frozen=True)
class Shard:
    """One input file of a dataset."""

    url: str             # full URL or absolute path, as given to fsspec
    size: int
    version: str         # mtime or ETag: a changed file changes the dataset fingerprint
    layout: str          # jsonl | text | parquet | tar
    compression: str | None


@dataclasses.dataclass(frozen=True)
class MissingSource:
    """A source pattern or file that cannot be read, with the reason."""

    source: str      # readable_url of the source
    reason: str


def readable_url(url: str) -> str:
    """``url`` printable and storable as UTF-8 text: bytes of a file name that are not UTF-8 (held
    by Python as surrogate escapes) are shown as ``\\xNN``. Only for messages and display; the
    lossless name is :func:`url_bytes`."""
    return url.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def url_bytes(url: str) -> bytes:
    """The exact bytes of ``url`` (file names that are not UTF-8 included)."""
    return url.encode("utf-8", "surrogateescape")


def url_from_bytes(raw: bytes) -> str:
    """The URL whose :func:`url_bytes` are ``raw``."""
    return bytes(raw).decode("utf-8", "surrogateescape")


def layout_of(url: str) -> tuple[str, str | None]:
    """(layout, compression) from a file name's suffix; SourceError for unsupported names."""
    name = url.lower()
    for suffix in sorted(_LAYOUTS, key=len, reverse=True):
        if name.endswith(suffix):
            return _LAYOUTS[suffix]
    raise SourceError(
        f"{readable_url(url)}: unsupported file type; use one of {', '.join(sorted(_LAYOUTS))}"
    )


def _full_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if is_local(fs) else fs.unstrip_protocol(path)


def _version(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def expand_sources(
    patterns: list[str], storage_options: dict[str, Any]
) -> tuple[list[Shard], list[MissingSource]]:
    """Shards matched by ``patterns`` (sorted, de-duplicated) and the sources that matched nothing."""
    shards: dict[str, Shard] = {}
    missing: list[MissingSource] = []
    for pattern in patterns:
        fs, path = url_to_fs(pattern, **storage_options)
        if fsspec.core.has_magic(path):
            infos = fs.glob(path, detail=True)
            if not infos:
                missing.append(MissingSource(pattern, "pattern matched no files"))
        else:
            try:
                infos = {path: fs.info(path)}
            except FileNotFoundError:
                missing.append(MissingSource(pattern, "file not found"))
                continue
            except OSError as exc:
                missing.append(MissingSource(pattern, f"cannot read: {exc}"))
                continue
        for found, info in sorted(infos.items()):
            url = _full_url(fs, found)
            if info.get("type") == "directory":
                missing.append(MissingSource(readable_url(url), "is a directory, not a file"))
                continue
            if is_local(fs):
                try:
                    with open(found, "rb"):
                        pass
                except OSError as exc:
                    missing.append(MissingSource(readable_url(url), f"cannot read: {exc.strerror or exc}"))
                    continue
            layout, compression = layout_of(url)
            shards[url] = Shard(url, int(info.get("size") or 0), _version(info), layout, compression)
    return [shards[url] for url in sorted(shards)], missing
