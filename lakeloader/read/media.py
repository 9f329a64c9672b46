"""Stored images read from a chunk's media file (:mod:`lakeloader.contracts.media`): one image is
one ranged read of its row group (one request in an object store; the file's footer parsed once
and kept), its pages' CRC-32 checked, and the sha256 of its bytes checked against its image id,
so a damaged or altered media file is a :class:`ChunkIntegrityError` naming it and the image,
never other pixels."""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from lakeloader.catalog.lake import Lake
from lakeloader.contracts.chunk_file import open_chunk
from lakeloader.contracts.errors import ChunkIntegrityError
from lakeloader.contracts.media import MEDIA_BYTES_COLUMN, MEDIA_HOMES_KEY, MEDIA_ID_COLUMN, image_id, media_path
from lakeloader.read.catalog_view import CatalogView
from lakeloader.read.lru import LRU
from lakeloader.read.pages import (
    PAGE_DATA,
    ColumnChunk,
    DamagedBytes,
    check_crc,
    column_chunk,
    read_page_header,
)
from lakeloader.storage import with_retries

FOOTERS_KEPT = 256   # media files whose footer and id -> row group map are kept


class _NotHeld(LookupError):
    """The media file read holds no such image; ``home``: the media file its footer names as
    holding it (a deduplicated file's), if any."""

    def __init__(self, home: str | None) -> None:
        super().__init__(home)
        self.home = home


class MediaFiles:
    """Reads images by id from the media files of a lake's chunks; with a catalog ``view``, from
    the one each chunk reads now (``contracts/media.py``: its own, or the one a build's end
    rewrote, whose footer names the home of each image it no longer holds)."""

    def __init__(self, lake: Lake, io_retry_deadline: float = 0.0, view: CatalogView | None = None) -> None:
        self.lake = lake
        self.io_retry_deadline = io_retry_deadline
        self.view = view
        self._footers: LRU[str, MediaFooter] = LRU(FOOTERS_KEPT)
        self._deduped: dict[str, str] | None = None   # chunk file -> its rewritten media file (the view's)

    def image_bytes(self, chunk_path: str, image: str) -> bytes:
        """The original bytes of image ``image`` (its id) of the chunk at lake path ``chunk_path``,
        checked: its row group's page checksums, and the sha256 of the bytes against the id."""
        try:
            return self._image_bytes(chunk_path, image)
        except ChunkIntegrityError:
            if self.view is None:
                raise
            # Where an older snapshot said, a file removed since (`lakeloader gc`): the newest says where it is.
            self.view.refresh()
            self._deduped = None
            return self._image_bytes(chunk_path, image)

    def _media_of(self, chunk_path: str) -> str:
        """The media file the chunk at ``chunk_path`` reads its images from."""
        if self.view is None:
            return media_path(chunk_path)
        if self._deduped is None:
            self._deduped = self.view.deduped_media()
        return self._deduped.get(chunk_path) or media_path(chunk_path)

    def _image_bytes(self, chunk_path: str, image: str) -> bytes:
        path = self._media_of(chunk_path)
        where = f"image {image[:16]}… of media file {self.lake.url_of(path)}"
        try:
            try:
                return with_retries(lambda: self._read(path, image, where), what=f"reading {where}",
                                    deadline=self.io_retry_deadline)
            except _NotHeld as moved:
                home = moved.home
                if home is None:
                    raise
                where = f"image {image[:16]}… of media file {self.lake.url_of(home)} (its home)"
                return with_retries(lambda: self._read(home, image, where), what=f"reading {where}",
                                    deadline=self.io_retry_deadline)
        except _NotHeld:
            raise ChunkIntegrityError(f"{where}: the media file holds no such image. The lake is damaged: run "
                                      "`lakeloader verify CONFIG --repair`") from None
        except FileNotFoundError:
            raise ChunkIntegrityError(f"{where}: the media file is missing. The lake is damaged: run "
                                      "`lakeloader verify CONFIG --repair`") from None
        except (OSError, pa.ArrowException) as exc:
            raise ChunkIntegrityError(f"{where} cannot be read ({type(exc).__name__}: {exc}); the damaged data was "
                                      "not used. Run `lakeloader verify CONFIG --repair`") from exc

    def _read(self, path: str, image: str, where: str) -> bytes:
        footer = self._footers.get(path, lambda: self._footer(path))
        row = footer.rows.get(image)
        if row is None:
            raise _NotHeld(footer.homes.get(image))
        chunk = footer.chunks[row]
        data = None if chunk is None else _page_value(self._range(path, chunk.data_page_offset,
                                                                  chunk.total_compressed_size), chunk)
        if data is None:   # stored otherwise than this contract's writer stores it: pyarrow reads it
            with self._open(path) as handle:
                table = open_chunk(handle, footer.metadata).read_row_group(row, columns=[MEDIA_BYTES_COLUMN],
                                                                           use_threads=False)
            column = table.column(MEDIA_BYTES_COLUMN)
            data = column[0].as_py() if len(column) == 1 else None
        if not isinstance(data, bytes) or image_id(data) != image:
            raise ChunkIntegrityError(f"{where}: its stored bytes do not hash to its id (the file was altered or "
                                      "damaged); never decoded. Run `lakeloader verify CONFIG --repair`")
        return data

    def _open(self, path: str) -> Any:
        # (a local lake's file opened directly: fsspec's open costs about as much as the read)
        where = self.lake.path_of(path)
        return open(where, "rb") if self.lake.is_local else self.lake.fs.open(where, "rb")

    def _footer(self, path: str) -> MediaFooter:
        with self._open(path) as handle:
            return _footer(handle)

    def _range(self, path: str, start: int, size: int) -> bytes:
        """``size`` bytes of the media file at ``start``: in an object store one ranged request
        (no open, whose size lookup and read-ahead would cost a request and more bytes each)."""
        if not self.lake.is_local:
            return bytes(self.lake.fs.cat_file(self.lake.path_of(path), start=start, end=start + size))
        where = self.lake.path_of(path)
        if hasattr(os, "pread"):   # (POSIX: one pread, no file object: half the cost of open, seek, read)
            descriptor = os.open(where, os.O_RDONLY)
            try:
                return os.pread(descriptor, size, start)
            finally:
                os.close(descriptor)
        with open(where, "rb") as handle:
            handle.seek(start)
            return handle.read(size)


class MediaFooter(NamedTuple):
    """What reading a media file's images needs of its footer, taken out once."""

    metadata: pq.FileMetaData
    rows: dict[str, int]                # image id -> its row group
    chunks: list[ColumnChunk | None]    # per row group: its bytes column chunk, None if not stored as
                                        # this contract's writer stores it (one uncompressed PLAIN page)
    homes: dict[str, str]               # a deduplicated file's: image id -> the media file holding it


def _page_value(chunk_bytes: bytes, chunk: ColumnChunk) -> bytes | None:
    """The one value of a ``bytes`` column chunk stored as this contract's writer stores it, from
    the chunk's bytes (one read), its page's CRC-32 checked; None for a page this parser does not take."""
    row = chunk.group
    raw = memoryview(chunk_bytes)
    try:
        header, start = read_page_header(raw, 0)
    except Exception:   # a header this parser does not take: pyarrow reads it (and names any damage)
        return None
    if header.type != PAGE_DATA or header.data_page_header is None or header.data_page_header.encoding != 0:
        return None
    page = raw[start : start + header.compressed_page_size]
    if len(page) != header.compressed_page_size or start + len(page) != len(raw):
        raise DamagedBytes(f"row group {row}: its page does not fill its column chunk")
    check_crc(header, page, 0)   # (the column chunk's one page)
    at = 4 + int.from_bytes(page[:4], "little") if chunk.max_definition_level else 0   # (the levels: one value)
    length = int.from_bytes(page[at : at + 4], "little")
    if at + 4 + length != len(page):
        raise DamagedBytes(f"row group {row}: a value of {length} bytes does not fill its page")
    return bytes(page[at + 4 :])


def _plain_chunk(metadata: pq.FileMetaData, row: int, column: int) -> ColumnChunk | None:
    chunk = column_chunk(metadata, row, column)
    if (chunk.compression != "UNCOMPRESSED" or chunk.has_dictionary_page or chunk.physical_type != "BYTE_ARRAY"
            or chunk.max_repetition_level or chunk.num_values != 1):
        return None
    return chunk


def _footer(handle: object) -> MediaFooter:
    """A media file's footer and where each image id lies (its row group), from the id column's
    statistics (one value per row group) or, where the writer kept none, the column itself."""
    parquet = open_chunk(handle)  # type: ignore[arg-type]
    metadata = parquet.metadata
    index = parquet.schema_arrow.get_field_index(MEDIA_ID_COLUMN)
    ids: list[str | None] = []
    for group in range(metadata.num_row_groups):
        stats = metadata.row_group(group).column(index).statistics
        ids.append(stats.min if stats is not None and stats.has_min_max and stats.min == stats.max else None)
    if None in ids:
        ids = parquet.read(columns=[MEDIA_ID_COLUMN], use_threads=False).column(MEDIA_ID_COLUMN).to_pylist()
        if len(ids) != metadata.num_row_groups:
            raise pa.ArrowInvalid(f"{len(ids)} image ids in {metadata.num_row_groups} row groups, expected one each")
    column = metadata.schema.names.index(MEDIA_BYTES_COLUMN)
    return MediaFooter(metadata, {image: row for row, image in enumerate(ids) if image is not None},
                       [_plain_chunk(metadata, row, column) for row in range(metadata.num_row_groups)],
                       _homes(metadata))


def _homes(metadata: pq.FileMetaData) -> dict[str, str]:
    """The homes a deduplicated media file's footer names (``MEDIA_HOMES_KEY``); none for another
    (a ValueError if they are not an object of strings: each is checked as a name inside the lake
    when it is read)."""
    raw = (metadata.metadata or {}).get(MEDIA_HOMES_KEY)
    if raw is None:
        return {}
    try:
        homes = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise pa.ArrowInvalid(f"its footer's {MEDIA_HOMES_KEY.decode()} is not JSON ({exc})") from None
    if not isinstance(homes, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in homes.items()):
        raise pa.ArrowInvalid(f"its footer's {MEDIA_HOMES_KEY.decode()} is not an object of image ids and paths")
    return homes
