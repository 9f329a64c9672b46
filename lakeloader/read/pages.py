"""The data pages of one Parquet column chunk decoded to a numpy array, for the way chunk files store
tokens: PLAIN INT32 values, RLE levels, ZSTD or no compression, data pages v1. One read of the
column chunk, each page's CRC-32 checked, the levels skipped (a list column's are most of what a
general reader spends its time on), the values cast once. A column stored any other way is None:
the caller reads it with pyarrow, so every valid file still reads, to the same values."""

from __future__ import annotations

import functools
import logging
import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

log = logging.getLogger(__name__)

# Parquet's PageType, Encoding and Thrift compact-protocol type codes (parquet.thrift, the Thrift spec).
PAGE_DATA = 0   # dictionary pages (2) and data pages v2 (3) are left to pyarrow
ENCODING_PLAIN, ENCODING_RLE = 0, 3
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
_MAX_DEPTH = 32   # nesting of skipped structs; page headers nest 3 deep
# A column chunk larger than this read for a few of its values has its page headers read one by
# one (each from a probe of this many bytes), then only the pages holding the values.
_PROBED_SIZE = 64 << 10
_HEADER_PROBE = 256

# Arrow value types read from INT32 as numpy casts them (pyarrow truncates the same way, unchecked).
_DTYPES = {pa.int8(): np.int8, pa.uint8(): np.uint8, pa.int16(): np.int16, pa.uint16(): np.uint16,
           pa.int32(): np.int32, pa.uint32(): np.uint32}


class PageChecksumError(OSError):
    """A page whose bytes do not match the CRC-32 its writer stored. Worded as pyarrow's checked
    read words it, so a chunk's error reads the same whichever reader found the damage."""

    def __init__(self, ordinal: int) -> None:
        super().__init__(f"could not verify page integrity, CRC checksum verification failed for page_ordinal {ordinal}")


class DamagedBytes(OSError):
    """Bytes of a chunk file that make no sense where a page's CRC-32 does not reach: a footer that
    does not decode, sizes out of range, counts that do not add up."""


class _NotDecoded(Exception):
    """Why a column chunk is left to pyarrow (a layout not decoded here, or bytes that make no sense:
    pyarrow then reports them as it always has)."""


class DataPageHeader(NamedTuple):
    num_values: int                 # level entries (values, nulls and empty lists), not values
    encoding: int
    definition_level_encoding: int
    repetition_level_encoding: int


class PageHeader(NamedTuple):
    type: int
    uncompressed_page_size: int
    compressed_page_size: int
    crc: int | None                 # signed 32-bit as stored; None for a page written without one
    data_page_header: DataPageHeader | None = None   # data pages v1 only (any other is left to pyarrow)


# One Thrift struct's fields by id: integers and booleans as values, nested structs as their fields.
_Fields = dict[int, "int | bool | _Fields"]


def _byte(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(the byte at ``data[pos]``, where it ends)."""
    if pos >= len(data):
        raise _NotDecoded("page header runs past the column chunk")
    return data[pos], pos + 1


def _varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(the unsigned varint at ``data[pos]``, where it ends)."""
    value = shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise _NotDecoded("page header runs past the column chunk")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise _NotDecoded("varint longer than 10 bytes in a page header")


def _struct(data: bytes | memoryview, pos: int, depth: int = 0) -> tuple[_Fields, int]:
    """The Thrift compact-protocol struct at ``data[pos]`` (its fields of other types skipped), and
    where it ends. One pass over the bytes: a loader's first batch walks the headers of many pages."""
    if depth > _MAX_DEPTH:
        raise _NotDecoded("page header nests too deep")
    found: _Fields = {}
    field_id = 0
    end = len(data)
    while True:
        if pos >= end:   # (_byte inline: ~10% of a header's walk)
            raise _NotDecoded("page header runs past the column chunk")
        head = data[pos]
        pos += 1
        if not head:
            return found, pos
        kind = head & 0x0F
        if head >> 4:
            field_id += head >> 4
        else:
            number, pos = _varint(data, pos)
            field_id = (number >> 1) ^ -(number & 1)
        if _I16 <= kind <= _I64:
            number, pos = _varint(data, pos)
            found[field_id] = (number >> 1) ^ -(number & 1)
        elif kind == _TRUE or kind == _FALSE:
            found[field_id] = kind == _TRUE
        elif kind == _STRUCT:
            found[field_id], pos = _struct(data, pos, depth + 1)
        else:
            pos = _skip(data, pos, kind, depth + 1)


def _skip(data: bytes | memoryview, pos: int, kind: int, depth: int, in_collection: bool = False) -> int:
    """Where the value of Thrift type ``kind`` at ``data[pos]`` ends."""
    if depth > _MAX_DEPTH:
        raise _NotDecoded("page header nests too deep")
    if kind in (_TRUE, _FALSE):
        return pos + 1 if in_collection else pos   # a struct field's boolean is in its type; a list's takes a byte
    if kind == _BYTE:
        size = 1
    elif kind in (_I16, _I32, _I64):
        return _varint(data, pos)[1]
    elif kind == _DOUBLE:
        size = 8
    elif kind == _BINARY:
        size, pos = _varint(data, pos)
    elif kind in (_LIST, _SET):
        head, pos = _byte(data, pos)
        count = head >> 4
        if count == 15:
            count, pos = _varint(data, pos)
        for _ in range(count):   # each element takes at least a byte: bounded by the data
            pos = _skip(data, pos, head & 0x0F, depth + 1, True)
        return pos
    elif kind == _MAP:
        count, pos = _varint(data, pos)
        types = 0
        if count:
            types, pos = _byte(data, pos)
        for _ in range(count):
            pos = _skip(data, pos, types >> 4, depth + 1, True)
            pos = _skip(data, pos, types & 0x0F, depth + 1, True)
        return pos
    elif kind == _STRUCT:
        return _struct(data, pos, depth)[1]
    else:
        raise _NotDecoded(f"unknown Thrift type {kind} in a page header")
    if pos + size > len(data):
        raise _NotDecoded("page header runs past the column chunk")
    return pos + size


def _int(fields: _Fields, field_id: int, name: str) -> int:
    value = fields.get(field_id)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _NotDecoded(f"page header without a valid {name}")
    return value


def read_page_header(data: bytes | memoryview, pos: int) -> tuple[PageHeader, int]:
    """The page header starting at ``data[pos]`` and where the page's bytes start."""
    fields, end = _struct(data, pos)
    v1 = fields.get(5)
    if v1 is not None and not isinstance(v1, dict):
        raise _NotDecoded("page header field 5 is not a struct")
    crc = fields.get(4)
    header = PageHeader(
        type=_int(fields, 1, "type"),
        uncompressed_page_size=_int(fields, 2, "uncompressed_page_size"),
        compressed_page_size=_int(fields, 3, "compressed_page_size"),
        crc=None if crc is None else _int(fields, 4, "crc"),
        data_page_header=None if v1 is None else DataPageHeader(
            _int(v1, 1, "num_values"), _int(v1, 2, "encoding"), _int(v1, 3, "definition_level_encoding"),
            _int(v1, 4, "repetition_level_encoding")),
    )
    return header, end


def _field(data: memoryview, pos: int, field_id: int) -> tuple[int, int, int]:
    """(the Thrift type of the struct field whose header is at ``data[pos]``, 0 at the struct's
    end; its id, the previous field's being ``field_id``; where its value starts)."""
    head, pos = _byte(data, pos)
    if not head:
        return 0, field_id, pos
    if head >> 4:
        return head & 0x0F, field_id + (head >> 4), pos
    number, pos = _varint(data, pos)
    return head & 0x0F, (number >> 1) ^ -(number & 1), pos


def _structs(data: memoryview, pos: int) -> tuple[int, int]:
    """(the length of the list of structs whose header is at ``data[pos]``, where its first starts)."""
    head, pos = _byte(data, pos)
    count = head >> 4
    if count == 15:
        count, pos = _varint(data, pos)
    if head & 0x0F != _STRUCT:
        raise _NotDecoded("a footer list of other than structs")
    return count, pos


class RowGroupLayout(NamedTuple):
    num_rows: int
    columns: list[_Fields]   # each column chunk's ColumnMetaData: its integers and booleans by field id


def _row_group(data: memoryview, pos: int) -> tuple[RowGroupLayout, int]:
    columns: list[_Fields] | None = None
    num_rows = None
    field_id = 0
    while True:
        kind, field_id, pos = _field(data, pos, field_id)
        if not kind:
            break
        if field_id == 1 and kind == _LIST:
            count, pos = _structs(data, pos)
            columns = []
            for _ in range(count):
                chunk, pos = _struct(data, pos, 2)
                meta = chunk.get(3)
                if not isinstance(meta, dict):
                    raise _NotDecoded("a column chunk without its metadata")
                columns.append(meta)
        elif field_id == 3 and kind == _I64:
            number, pos = _varint(data, pos)
            num_rows = (number >> 1) ^ -(number & 1)
        elif kind not in (_TRUE, _FALSE):
            pos = _skip(data, pos, kind, 2)
    if columns is None or num_rows is None or num_rows < 0:
        raise _NotDecoded("a row group without its columns or rows")
    return RowGroupLayout(num_rows, columns), pos


def footer_row_groups(footer: bytes, data_end: int | None = None) -> list[RowGroupLayout]:
    """Each row group of the file whose serialized FileMetaData is ``footer``: its rows and its
    column chunks' metadata, read here rather than through pyarrow's metadata objects (asking one
    for a column chunk whose codec or level histograms are damaged aborts the process: a C++
    exception through Cython). Raises :class:`DamagedBytes` where the footer does not decode to
    the whole of its bytes or a column chunk lies outside the file's data (``data_end``: where
    its footer starts)."""
    data = memoryview(footer)
    groups: list[RowGroupLayout] | None = None
    try:
        pos = field_id = 0
        while True:
            kind, field_id, pos = _field(data, pos, field_id)
            if not kind:
                break
            if field_id == 4 and kind == _LIST:
                count, pos = _structs(data, pos)
                groups = []
                for _ in range(count):
                    group, pos = _row_group(data, pos)
                    groups.append(group)
            elif kind not in (_TRUE, _FALSE):
                pos = _skip(data, pos, kind, 1)
        if pos != len(data):
            raise _NotDecoded(f"{len(data) - pos} bytes after its end")
        if groups is None:
            raise _NotDecoded("no row groups")
        for number, group in enumerate(groups):
            for column, meta in enumerate(group.columns):
                # type, codec, num_values, total_compressed_size, data_page_offset (and a dictionary
                # page's offset: that page comes first)
                values = [meta.get(field_id) for field_id in (1, 4, 5, 7, 9)]
                start = meta.get(11, values[4])
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in (*values, start)):
                    raise _NotDecoded(f"row group {number}, column {column}: metadata without its sizes or types")
                if values[3] == 0 == values[2]:   # (an empty row group's: no pages, no offsets)
                    continue
                if not (4 <= start <= values[4] and values[2] >= 0 and values[3] >= 0
                        and (data_end is None or start + values[3] <= data_end)):
                    raise _NotDecoded(f"row group {number}, column {column}: sizes or offsets out of range")
    except _NotDecoded as exc:
        raise DamagedBytes(f"the footer does not decode: {exc}") from None
    return groups


def leaf_column(metadata: pq.FileMetaData, name: str) -> int | None:
    """The index of the one leaf column under top-level column ``name`` (None: absent or nested
    into several leaves)."""
    leaves = [i for i in range(metadata.num_columns) if metadata.schema.column(i).path.split(".")[0] == name]
    return leaves[0] if len(leaves) == 1 else None


class ColumnChunk(NamedTuple):
    """Where one leaf column's chunk of a row group lies in its file and how it is stored: what
    decoding it needs of the footer, taken out once (pyarrow's metadata objects cost microseconds
    per attribute, and a shuffled first batch reads many row groups)."""

    group: int
    column: int
    data_page_offset: int
    total_compressed_size: int
    num_values: int                 # level entries
    physical_type: str
    compression: str
    has_dictionary_page: bool
    max_repetition_level: int
    max_definition_level: int


_PHYSICAL_TYPES = ("BOOLEAN", "INT32", "INT64", "INT96", "FLOAT", "DOUBLE", "BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY")
_CODECS = ("UNCOMPRESSED", "SNAPPY", "GZIP", "LZO", "BROTLI", "LZ4", "ZSTD", "LZ4_RAW")


def _named(names: tuple[str, ...], value: int) -> str:
    return names[value] if 0 <= value < len(names) else f"unknown ({value})"


def layout_column_chunk(groups: list[RowGroupLayout], metadata: pq.FileMetaData, group: int,
                        column: int) -> ColumnChunk:
    """:func:`column_chunk` from the row groups :func:`footer_row_groups` read of the footer
    (``metadata``: pyarrow's parse of it, for the schema's levels)."""
    meta = groups[group].columns[column]
    schema = metadata.schema.column(column)
    return ColumnChunk(group, column, meta[9], meta[7], meta[5], _named(_PHYSICAL_TYPES, meta[1]),
                       _named(_CODECS, meta[4]), 11 in meta, schema.max_repetition_level,
                       schema.max_definition_level)


def column_chunk(metadata: pq.FileMetaData, group: int, column: int) -> ColumnChunk:
    """Leaf column ``column``'s chunk in row group ``group`` of the file whose footer is ``metadata``
    (an intact footer: readers of a lake's files use :func:`layout_column_chunk`)."""
    chunk = metadata.row_group(group).column(column)
    schema = metadata.schema.column(column)
    return ColumnChunk(group, column, chunk.data_page_offset, chunk.total_compressed_size, chunk.num_values,
                       chunk.physical_type, chunk.compression, chunk.has_dictionary_page,
                       schema.max_repetition_level, schema.max_definition_level)


def _skip_level_block(page: memoryview, pos: int, encoding: int, max_level: int) -> int:
    """Where a v1 page's levels of one kind end (an RLE block: 4-byte length, then the runs)."""
    if max_level == 0:
        return pos
    if encoding != ENCODING_RLE:
        raise _NotDecoded(f"levels of encoding {encoding}, not RLE")
    if pos + 4 > len(page):
        raise _NotDecoded("level block runs past the page")
    return pos + 4 + int.from_bytes(page[pos:pos + 4], "little")


def read_column_ranges(handle: pa.NativeFile, chunk: ColumnChunk, value_type: pa.DataType, count: int,
                       ranges: Sequence[tuple[int, int]]) -> list[np.ndarray] | None:
    """Values ``[start, stop)``, for each of ``ranges``, of the ``count`` values of column chunk
    ``chunk`` (read-only, of the numpy type of ``value_type``, the column's Arrow value type),
    bitwise what pyarrow decodes, read with one read of ``handle``. Only the
    pages holding them are decompressed and checked when every level entry of the column chunk is
    a value (no empty list, no null: a page header's count is then its values'); otherwise every
    page is. Raises :class:`PageChecksumError` for a page that fails its CRC-32. None when the
    column chunk is stored in a way not decoded here (a dictionary, another encoding, codec or page
    version, nulls among the values, a value type wider than INT32) or its pages make no sense:
    read it with pyarrow then."""
    for start, stop in ranges:
        if not 0 <= start <= stop <= count:
            raise ValueError(f"values [{start}, {stop}) of a column chunk of {count}")
    try:
        return _read_values(handle, chunk, value_type, count, ranges)
    except _NotDecoded as reason:
        log.debug("row group %d, column %d left to pyarrow: %s", chunk.group, chunk.column, reason)
        return None


class _Page(NamedTuple):
    ordinal: int
    header: PageHeader
    data_page_header: DataPageHeader
    start: int          # where the page's bytes as stored (compressed) lie in the column chunk
    stop: int


def _data_pages(header_at: Callable[[int], tuple[PageHeader, int]], size: int, entries: int) -> list[_Page]:
    """The first pages of a column chunk of ``size`` bytes that hold ``entries`` level entries (or
    all of them), each a PLAIN data page v1 (else :class:`_NotDecoded`); ``header_at(pos)`` is
    the page header at ``pos`` in the column chunk and where the page's bytes start."""
    pages: list[_Page] = []
    pos = held = 0
    while pos < size and held < entries:
        header, start = header_at(pos)
        stop = start + header.compressed_page_size
        if header.compressed_page_size < 0 or stop > size:
            raise _NotDecoded("page runs past the column chunk")
        page_header = header.data_page_header
        if header.type != PAGE_DATA or page_header is None:
            raise _NotDecoded(f"page of type {header.type}")
        if page_header.encoding != ENCODING_PLAIN:
            raise _NotDecoded(f"values of encoding {page_header.encoding}")
        pages.append(_Page(len(pages), header, page_header, start, stop))
        held += page_header.num_values
        pos = stop
    return pages


def _probed_header_at(handle: pa.NativeFile, chunk: ColumnChunk) -> Callable[[int], tuple[PageHeader, int]]:
    """``header_at`` of :func:`_data_pages` reading only a page header's bytes from ``handle``
    (a header longer than the probe is read again from a probe twice as long)."""
    size = chunk.total_compressed_size

    def header_at(pos: int) -> tuple[PageHeader, int]:
        length = min(_HEADER_PROBE, size - pos)
        while True:
            try:
                header, end = read_page_header(memoryview(handle.read_at(length, chunk.data_page_offset + pos)), 0)
                return header, pos + end
            except _NotDecoded:
                if length == size - pos:
                    raise
                length = min(2 * length, size - pos)

    return header_at


def check_crc(header: PageHeader, raw: memoryview, ordinal: int) -> None:
    """:class:`PageChecksumError` if page ``ordinal``'s stored bytes ``raw`` do not match the CRC-32
    its ``header`` gives (a page stored without one is not checked)."""
    if header.crc is not None and zlib.crc32(raw) != header.crc & 0xFFFFFFFF:
        raise PageChecksumError(ordinal)


def _page_values(page: _Page, raw: memoryview, decompress: Callable[[memoryview], bytes] | None, max_rep: int,
                 max_def: int) -> tuple[memoryview, int, int]:
    """(a page's decompressed bytes, where its values start, how many), from ``raw``, its bytes
    as stored: their CRC-32 checked."""
    header, page_header = page.header, page.data_page_header
    check_crc(header, raw, page.ordinal)
    body = raw
    if decompress is not None:
        try:
            # The frame's own size is what gets allocated: it must be the header's (Arrow's
            # writer always stores it), whatever a page without a CRC may have had altered.
            if zstandard.frame_content_size(raw) != header.uncompressed_page_size:
                raise _NotDecoded("zstd frame of another size than its page header says")
            body = memoryview(decompress(raw))
        except zstandard.ZstdError as exc:
            raise _NotDecoded(f"zstd: {exc}") from exc
    if len(body) != header.uncompressed_page_size:
        raise _NotDecoded(f"page of {len(body)} bytes, its header says {header.uncompressed_page_size}")
    at = _skip_level_block(body, 0, page_header.repetition_level_encoding, max_rep)
    at = _skip_level_block(body, at, page_header.definition_level_encoding, max_def)
    values = len(body) - at
    if values < 0 or values % 4:
        raise _NotDecoded(f"{values} bytes of INT32 values")
    values //= 4
    # Level entries count values, nulls and empty lists: never fewer than the values stored.
    if values > page_header.num_values or (max_def == 0 and values != page_header.num_values):
        raise _NotDecoded(f"{values} values in a page of {page_header.num_values}")
    return body, at, values


def _read_values(handle: pa.NativeFile, chunk: ColumnChunk, value_type: pa.DataType, count: int,
                 ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    dtype = _DTYPES.get(value_type)
    if chunk.physical_type != "INT32" or dtype is None:
        raise _NotDecoded(f"{chunk.physical_type} values of Arrow type {value_type}")
    if chunk.has_dictionary_page:
        raise _NotDecoded("dictionary page")
    if chunk.compression not in ("ZSTD", "UNCOMPRESSED"):
        raise _NotDecoded(f"{chunk.compression} compression")
    size = chunk.total_compressed_size
    # Every level entry a value: the pages holding the ranges are known from the page headers up
    # to the last range's end, without decoding them.
    every_entry_a_value = chunk.num_values == count
    needed = max((stop for _, stop in ranges), default=0) if every_entry_a_value else chunk.num_values
    wanted = sum(stop - start for start, stop in ranges)
    if every_entry_a_value and size > _PROBED_SIZE and 2 * wanted < count:
        # A few values of a large column chunk (a stretch of a row group): its page headers read
        # one by one, then only the pages holding them.
        pages = _data_pages(_probed_header_at(handle, chunk), size, needed)
        data = None
    else:
        data = memoryview(handle.read_at(size, chunk.data_page_offset))
        if len(data) != size:
            raise _NotDecoded(f"{len(data)} of the column chunk's {size} bytes read")
        pages = _data_pages(functools.partial(read_page_header, data), size, needed)
    entries = [page.data_page_header.num_values for page in pages]
    walked = sum(entries)
    if not needed <= walked <= chunk.num_values:
        raise _NotDecoded(f"{walked} level entries in pages of a column chunk of {chunk.num_values}")
    decompress = zstandard.ZstdDecompressor().decompress if chunk.compression == "ZSTD" else None
    # One page's values are taken as they lie in its decompressed bytes (read-only) where their
    # type is stored as it is read (4 bytes), else converted.
    as_stored = np.dtype(dtype).itemsize == 4

    def decoded(chosen: list[_Page], expected: int) -> np.ndarray:
        if data is None:   # (probed) the pages chosen read in one span
            base = chosen[0].start
            span = memoryview(handle.read_at(chosen[-1].stop - base, chunk.data_page_offset + base))
            raws = [span[page.start - base:page.stop - base] for page in chosen]
        else:
            raws = [data[page.start:page.stop] for page in chosen]
        if len(chosen) == 1 and as_stored:
            body, at, values = _page_values(chosen[0], raws[0], decompress, chunk.max_repetition_level,
                                            chunk.max_definition_level)
            if values != expected:
                raise _NotDecoded(f"{values} values in the page decoded, expected {expected}")
            return np.frombuffer(body, np.dtype(dtype).newbyteorder("<"), values, at)
        out = np.empty(expected, dtype)
        filled = 0
        for page, raw in zip(chosen, raws):
            body, at, values = _page_values(page, raw, decompress, chunk.max_repetition_level,
                                            chunk.max_definition_level)
            if filled + values > expected:
                raise _NotDecoded(f"more than the {expected} values expected")
            out[filled:filled + values] = np.frombuffer(body, "<i4", values, at)
            filled += values
        if filled != expected:
            raise _NotDecoded(f"{filled} values in the pages decoded, expected {expected}")
        out.flags.writeable = False
        return out

    if not every_entry_a_value or (len(pages) == 1 and walked == count and wanted):
        # Where a page's values start is not known, or one page holds them all: all decoded.
        whole = decoded(pages, count)
        return [whole[start:stop] for start, stop in ranges]
    # Each page holds values [ends[i - 1], ends[i]): the pages [lo, hi) each range reaches, each
    # decoded once.
    ends = np.cumsum(entries)
    firsts = ends - entries
    reaching = [(int(np.searchsorted(ends, start, "right")), int(np.searchsorted(ends, stop, "left")) + 1)
                if stop > start else (0, 0) for start, stop in ranges]
    page_values = {i: decoded([pages[i]], entries[i]) for i in sorted({i for lo, hi in reaching
                                                                        for i in range(lo, hi)})}
    found = []
    for (start, stop), (lo, hi) in zip(ranges, reaching):
        pieces = [page_values[i][max(start - int(firsts[i]), 0) : stop - int(firsts[i])] for i in range(lo, hi)]
        values = pieces[0] if len(pieces) == 1 else np.concatenate([np.zeros(0, dtype), *pieces])
        values.flags.writeable = False
        found.append(values)
    return found
