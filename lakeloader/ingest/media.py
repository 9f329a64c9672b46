"""Stored images of a split (``interleaved.images: stored``): each image part's bytes read (from
the record, a path or URL through fsspec, or a tar member), checked once with Pillow, and the
chunk's media file (``contracts/media.py``) encoded from the documents kept."""

from __future__ import annotations

import dataclasses
import io
import json
import posixpath
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from lakeloader.contracts.formats import Document, Part
from lakeloader.contracts.media import MEDIA_HOMES_KEY, MEDIA_ID_COLUMN, MEDIA_SCHEMA, image_id
from lakeloader.images import BadImage, ImageInfo, inspect_image
from lakeloader.storage import is_transient


@dataclasses.dataclass(frozen=True)
class StoredImages:
    """A chunk's images: the distinct ones in order of first use with their bytes and what Pillow
    said of them, each image part's size (0 for text parts, in part order), and one row per
    occurrence (``contracts.chunk_file.IMAGE_ROW_FIELDS``)."""

    ids: list[str]
    data: list[bytes]
    infos: list[ImageInfo]
    part_widths: np.ndarray     # int32 per part of the kept documents
    part_heights: np.ndarray
    rows: tuple[tuple[Any, ...], ...]


def _is_url(ref: str) -> bool:
    return "://" in ref


def image_url(ref: str, source_url: str) -> str:
    """Where an image named ``ref`` in the file at ``source_url`` is: a URL or absolute path as
    it is, a relative path against the source file's folder."""
    if _is_url(ref) or ref.startswith("/"):
        return ref
    return posixpath.join(posixpath.dirname(source_url), ref)


def _read_image(url: str, storage_options: dict[str, Any]) -> bytes:
    """The bytes at ``url``; BadImage if it cannot be read (transient storage errors propagate
    so the whole chunk is retried)."""
    try:
        fs, path = url_to_fs(url, **storage_options)
        return fs.cat_file(path)
    except FileNotFoundError:
        raise BadImage(f"{url}: not found") from None
    except (OSError, ValueError) as exc:
        if is_transient(exc):
            raise
        raise BadImage(f"{url}: cannot be read ({type(exc).__name__}: {exc})") from None


class _Resolver:
    """Reads and checks the images of one split, each distinct reference and content once."""

    def __init__(self, source_url: str, storage_options: dict[str, Any], max_pixels: int) -> None:
        self.source_url, self.storage_options, self.max_pixels = source_url, storage_options, max_pixels
        self.fetched: dict[str, bytes] = {}
        self.good: dict[str, tuple[bytes, ImageInfo]] = {}   # image id -> its bytes and facts
        self.bad: dict[str, str] = {}                        # image id -> why it cannot be used

    def image(self, ref: str | bytes) -> str:
        """The id of the image ``ref`` holds or names; BadImage if it is not usable."""
        if isinstance(ref, str):
            data = self.fetched.get(ref)
            if data is None:
                data = self.fetched[ref] = _read_image(image_url(ref, self.source_url), self.storage_options)
        else:
            data = ref
        key = image_id(data)
        if key not in self.good and key not in self.bad:
            try:
                self.good[key] = data, inspect_image(data, self.max_pixels)
            except BadImage as exc:
                self.bad[key] = str(exc)
        if key in self.bad:
            raise BadImage(self.bad[key])
        return key


def _describe(ref: str | bytes) -> str:
    return f"image {ref!r}" if isinstance(ref, str) else f"image of {len(ref)} bytes"


def resolve_images(documents: list[Document], source_url: str, storage_options: dict[str, Any],
                   max_pixels: int, reject: Callable[[int, int, str, str], None]
                   ) -> tuple[list[Document], np.ndarray, StoredImages]:
    """Read and check every image part of ``documents``; a document with an image that cannot be
    used is dropped after ``reject(document index, item index, the image described, why)`` (which
    raises under ``on_error: raise``). Returns the kept documents, each image part's ref its image
    id, the kept documents' indices, and the chunk's images."""
    resolver = _Resolver(source_url, storage_options, max_pixels)
    kept: list[Document] = []
    kept_index: list[int] = []
    for index, document in enumerate(documents):
        parts = []
        for item, part in enumerate(document):
            if part.kind != 1 or part.ref is None:
                parts.append(part)
                continue
            try:
                key = resolver.image(part.ref)
            except BadImage as exc:
                reject(index, item, _describe(part.ref), str(exc))
                break
            parts.append(Part(1, "", key))
        else:
            kept.append(tuple(parts))
            kept_index.append(index)
    return kept, np.array(kept_index, dtype=np.int64), _stored(kept, resolver.good)


def no_images() -> StoredImages:
    """The images of a chunk without any."""
    empty = np.zeros(0, dtype=np.int32)
    return StoredImages([], [], [], empty, empty, ())


def _stored(documents: list[Document], checked: dict[str, tuple[bytes, ImageInfo]]) -> StoredImages:
    """The images of the kept ``documents`` (image parts holding ids of ``checked``)."""
    order: dict[str, int] = {}
    widths, heights, rows = [], [], []
    for doc, document in enumerate(documents):
        image = 0
        for part in document:
            if part.kind != 1:
                widths.append(0)
                heights.append(0)
                continue
            key = str(part.ref)
            info = checked[key][1]
            order.setdefault(key, len(order))
            widths.append(info.width)
            heights.append(info.height)
            rows.append((doc, image, key, info.width, info.height, info.format, info.mode, info.num_bytes))
            image += 1
    ids = list(order)
    return StoredImages(ids, [checked[key][0] for key in ids], [checked[key][1] for key in ids],
                        np.array(widths, dtype=np.int32), np.array(heights, dtype=np.int32), tuple(rows))


def encode_media_file(images: StoredImages) -> bytes:
    """The media file of a chunk's ``images`` (``contracts/media.py``): a row and a row group per
    distinct image in order of first use, bytes uncompressed, no dictionary, page checksums;
    deterministic in its inputs."""
    return _encode_media_table(pa.table([
        pa.array(images.ids, pa.string()), pa.array(images.data, pa.binary()),
        pa.array([i.width for i in images.infos], pa.int32()), pa.array([i.height for i in images.infos], pa.int32()),
        pa.array([i.format for i in images.infos], pa.string()), pa.array([i.mode for i in images.infos], pa.string()),
    ], schema=MEDIA_SCHEMA))


def keep_images(data: bytes, keep: Collection[str], homes: dict[str, str]) -> tuple[bytes, int]:
    """The media file ``data`` without the images not in ``keep`` (ids), the others in their order,
    its footer naming the home (a lake path) of each image dropped (``homes``), written as
    :func:`encode_media_file` writes (so a file rewritten twice is the same bytes); and how many
    images it holds."""
    table = pq.read_table(pa.BufferReader(data), use_threads=False)
    kept = table.filter(pc.is_in(table.column(MEDIA_ID_COLUMN), pa.array(sorted(keep), pa.string())))
    schema = MEDIA_SCHEMA.with_metadata({MEDIA_HOMES_KEY: json.dumps(homes, sort_keys=True, separators=(",", ":"))})
    return _encode_media_table(pa.table(kept.columns, schema=schema)), kept.num_rows


def _encode_media_table(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pq.ParquetWriter(sink, table.schema, compression="none", use_dictionary=False, write_statistics=False,
                          store_schema=True, write_page_checksum=True) as writer:
        for row in range(len(table)):
            writer.write_table(table.slice(row, 1), row_group_size=1)
    return sink.getvalue()
