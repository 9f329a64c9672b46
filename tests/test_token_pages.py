"""Token pages decoded by lakeloader itself (lakeloader.read.pages): bitwise what pyarrow decodes,
every page's CRC-32 checked, and pyarrow for any column chunk stored otherwise."""

from __future__ import annotations

import functools
import io
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

import lakeloader.ingest.chunk as chunk_module
import lakeloader.read.chunks as chunks_module
import lakeloader.read.pages as pages_module
from lakeloader.catalog.lake import open_lake
from lakeloader.contracts.chunk_file import (
    PART_KINDS_COLUMN,
    PART_LENGTHS_COLUMN,
    TOKENS_COLUMN,
    ChunkParts,
    open_chunk,
    table_parts,
)
from lakeloader.contracts.errors import ChunkIntegrityError
from lakeloader.feed.loader import Loader
from lakeloader.ingest.chunk import EncodedParts, chunk_table, encode_chunk_file, row_group_bounds
from lakeloader.read.catalog_view import CatalogView
from lakeloader.read.chunks import ChunkFiles, Footer
from lakeloader.read.pages import (
    PageChecksumError,
    column_chunk,
    leaf_column,
    read_column_ranges,
    read_page_header,
)

from conftest import Lakes, assert_batches_equal, small_lake_request

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def chunk_bytes(docs: list[list[list[int]]], dtype: type, row_group_tokens: int, **writer: object) -> bytes:
    """A chunk file of ``docs`` (each a list of parts, each a list of token ids) written by the
    build's own :func:`encode_chunk_file`, ``writer`` options replacing or added to its ParquetWriter's."""
    lengths = np.array([len(p) for d in docs for p in d], np.int64)
    parts = ChunkParts(lengths, np.zeros(len(lengths), np.int64),
                       np.repeat(np.arange(len(docs), dtype=np.int64), [len(d) for d in docs]), len(docs))
    ids = np.array([t for d in docs for p in d for t in p], dtype)
    table = chunk_table(list(range(len(docs))), EncodedParts(ids, parts, [None] * len(lengths)), False)
    bounds = row_group_bounds(parts.content_lengths, row_group_tokens)
    real = pq.ParquetWriter

    def writer_with_options(*args: Any, **options: Any) -> pq.ParquetWriter:
        return real(*args, **{**options, **writer})

    with mock.patch.object(chunk_module.pq, "ParquetWriter", writer_with_options):
        return encode_chunk_file(table, bounds)


def pyarrow_tokens(parquet: pq.ParquetFile, group: int) -> np.ndarray:
    """A row group's tokens as ChunkFiles read them with pyarrow."""
    array = parquet.read_row_group(group, columns=[TOKENS_COLUMN]).column(TOKENS_COLUMN).combine_chunks()
    offsets = array.offsets.to_numpy()
    return array.values.to_numpy()[offsets[0]:offsets[-1]]


def decoded(data: bytes, group: int, count: int | None = None) -> np.ndarray | None:
    """Row group ``group``'s tokens decoded by read_column_ranges, as one range (``count`` of them:
    by default as many as pyarrow reads)."""
    parquet = open_chunk(pa.BufferReader(data))
    metadata = parquet.metadata
    count = len(pyarrow_tokens(parquet, group)) if count is None else count
    found = read_column_ranges(pa.BufferReader(data), column_chunk(metadata, group, leaf_column(metadata, TOKENS_COLUMN)),
                               parquet.schema_arrow.field(TOKENS_COLUMN).type.value_type, count, [(0, count)])
    return None if found is None else found[0]


def num_pages(data: bytes, group: int) -> int:
    column = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(group).column(1)
    start = column.data_page_offset
    return data[start:start + column.total_compressed_size].count(ZSTD_MAGIC)


DOCS = st.lists(st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=60), min_size=1, max_size=3),
                min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(docs=DOCS, dtype=st.sampled_from([np.uint16, np.uint32]), row_group_tokens=st.integers(1, 800),
       page_bytes=st.integers(8, 2000), batch=st.integers(1, 300))
def test_pages_decode_bitwise_as_pyarrow(docs: list[list[list[int]]], dtype: type, row_group_tokens: int,
                                        page_bytes: int, batch: int) -> None:
    """Chunk files as the build writes them (any documents, empty ones too, any row groups, many
    pages each): every row group's tokens decode here, same dtype and bits as pyarrow's."""
    docs = [[[t % (np.iinfo(dtype).max + 1) for t in part] for part in doc] for doc in docs]
    data = chunk_bytes(docs, dtype, row_group_tokens, data_page_size=page_bytes, write_batch_size=batch)
    parquet = pq.ParquetFile(io.BytesIO(data))
    for group in range(parquet.metadata.num_row_groups):
        expected = pyarrow_tokens(parquet, group)
        got = decoded(data, group)
        assert got is not None, f"row group {group} left to pyarrow"
        assert got.dtype == expected.dtype == dtype and np.array_equal(got, expected)
        assert not got.flags.writeable   # cached and shared, as pyarrow's zero-copy arrays are


@settings(max_examples=60, deadline=None)
@given(docs=DOCS, single=st.booleans(), partless=st.sets(st.integers(0, 39), max_size=3),
       row_group_tokens=st.integers(1, 800), page_bytes=st.integers(8, 2000))
# As many parts as documents, yet not one each: a document of none beside one of two.
@example(docs=[[[1, 2]], [[5]], [[3], [4]]], single=False, partless={1}, row_group_tokens=800, page_bytes=2000)
def test_one_part_documents_have_their_layout_decoded_as_pyarrow_reads_it(
        docs: list[list[list[int]]], single: bool, partless: set[int], row_group_tokens: int, page_bytes: int) -> None:
    """A row group whose documents have one part each (plain text; empty parts too) has its part
    layout decoded here, equal to pyarrow's; any other row group (documents of several parts, or
    of none) is left to pyarrow (None)."""
    if single:
        docs = [doc[:1] for doc in docs]
    docs = [[] if i in partless else doc for i, doc in enumerate(docs)]
    docs = [[[t % 65536 for t in part] for part in doc] for doc in docs]
    data = chunk_bytes(docs, np.uint16, row_group_tokens, data_page_size=page_bytes, write_batch_size=7)
    parquet = open_chunk(pa.BufferReader(data))
    footer = Footer(parquet.metadata)
    for group in range(parquet.metadata.num_row_groups):
        expected = table_parts(parquet.read_row_groups([group], columns=[PART_LENGTHS_COLUMN, PART_KINDS_COLUMN]))
        got = footer.single_part_layout(pa.BufferReader(data), group)
        assert (got is not None) == bool((expected.parts_per_doc == 1).all()), group
        if got is not None:
            assert got.num_docs == expected.num_docs
            for name in ("part_lengths", "part_kinds", "part_doc"):
                assert getattr(got, name).dtype == np.int64 and np.array_equal(getattr(got, name), getattr(expected, name))


def page_spans(data: bytes, group: int) -> list[tuple[int, int, int]]:
    """(first byte of the payload, its end, level entries) of each page of ``group``'s tokens."""
    column = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(group).column(1)
    spans, pos = [], column.data_page_offset
    while pos < column.data_page_offset + column.total_compressed_size:
        header, start = read_page_header(memoryview(data), pos)
        pos = start + header.compressed_page_size
        spans.append((start, pos, header.data_page_header.num_values))
    return spans


class ReadsCounted:
    """A file's bytes whose reads (``read_at``, all a column chunk's decoding uses) are recorded."""

    def __init__(self, data: bytes) -> None:
        self.file = pa.BufferReader(data)
        self.reads: list[tuple[int, int]] = []   # (offset, length)

    def read_at(self, length: int, offset: int) -> pa.Buffer:
        self.reads.append((offset, length))
        return self.file.read_at(length, offset)


@settings(max_examples=100, deadline=None)
@given(docs=DOCS, page_bytes=st.integers(8, 400), probe=st.sampled_from([None, 4, 16, 256]), data=st.data())
def test_ranges_decode_only_the_pages_they_reach(docs: list[list[list[int]]], page_bytes: int, probe: int | None,
                                                 data: st.DataObject) -> None:
    """Values of any ranges of a row group's tokens are bitwise pyarrow's slices; when every level
    entry is a value (no empty document), pages no range reaches are never decompressed nor
    checked: here their bytes are damaged and the ranges still read. With page headers read one
    by one (``probe``: the bytes read for each, some shorter than a header; the files here are
    smaller than a column chunk needs to be for that), no byte of a page no range reaches is read."""
    docs = [[[t % 65536 for t in part] for part in doc] for doc in docs]
    file = chunk_bytes(docs, np.uint16, 10**6, data_page_size=page_bytes, write_batch_size=4)
    expected = pyarrow_tokens(pq.ParquetFile(io.BytesIO(file)), 0)
    n = len(expected)
    ranges = [tuple(sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2))))
              for _ in range(data.draw(st.integers(1, 4)))]
    spans = page_spans(file, 0)
    every_entry_a_value = sum(entries for _, _, entries in spans) == n
    damaged = bytearray(file)
    first = 0
    unreached = []
    for start, stop, entries in spans:
        reached = any(a < first + entries and b > first for a, b in ranges if b > a)
        if every_entry_a_value and not reached and stop > start:
            damaged[start] ^= 0xFF   # a page nobody needs: its CRC would fail if it were checked
            unreached.append((start, stop))
        first += entries
    parquet = open_chunk(pa.BufferReader(file))
    handle = ReadsCounted(bytes(damaged))
    probing = {"_PROBED_SIZE": 0, "_HEADER_PROBE": probe} if probe else {"_PROBED_SIZE": pages_module._PROBED_SIZE}
    with mock.patch.multiple(pages_module, **probing):
        tokens = column_chunk(parquet.metadata, 0, leaf_column(parquet.metadata, TOKENS_COLUMN))
        got = read_column_ranges(handle, tokens, pa.uint16(), n, ranges)
    assert got is not None and len(got) == len(ranges)
    for (a, b), values in zip(ranges, got):
        assert values.dtype == np.uint16 and np.array_equal(values, expected[a:b]), (a, b)
        assert not values.flags.writeable
    if probe is not None and every_entry_a_value and 2 * sum(b - a for a, b in ranges) < n:
        # Reads from a page's first byte are of pages; the others probe page headers, each from
        # its first byte and at most twice as long as the longest header if longer than the probe.
        starts = {start for start, _, _ in spans}
        read = [(offset, offset + length) for offset, length in handle.reads if offset in starts]
        assert bool(read) == any(b > a for a, b in ranges)
        header_starts = [parquet.metadata.row_group(0).column(1).data_page_offset] + [stop for _, stop, _ in spans]
        longest_header = max(start - header for (start, _, _), header in zip(spans, header_starts))
        for offset, length in handle.reads:
            assert offset in starts or (offset in header_starts and length <= max(probe, 2 * longest_header))
        assert not [page for page in unreached for a, b in read if a < page[1] and b > page[0]]


def test_a_range_reaching_a_damaged_page_raises() -> None:
    """Pages a range reaches are checked: damage in one raises, naming its ordinal."""
    docs = [[list(range(i, i + 50))] for i in range(40)]
    file = chunk_bytes(docs, np.uint16, 10_000, data_page_size=256, write_batch_size=4)
    spans = page_spans(file, 0)
    assert len(spans) > 5
    damaged = bytearray(file)
    damaged[spans[3][0]] ^= 0xFF
    parquet = open_chunk(pa.BufferReader(file))
    first = sum(entries for _, _, entries in spans[:3])
    read = functools.partial(read_column_ranges, pa.BufferReader(bytes(damaged)),
                             column_chunk(parquet.metadata, 0, leaf_column(parquet.metadata, TOKENS_COLUMN)),
                             pa.uint16(), 2000)
    assert read([(0, first)]) is not None
    with pytest.raises(PageChecksumError, match="page_ordinal 3"):
        read([(0, 1), (first, first + 1)])


# -- page headers: a Thrift compact-protocol writer of the tests' own -----------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n >> 7 else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _struct_bytes(fields: list[tuple[int, int, Any]]) -> bytes:
    """A compact-protocol struct of ``(field id, Thrift type, value)`` in the order given (a field
    id not 1-15 past the last one written takes the long form)."""
    out, last = bytearray(), 0
    for field_id, kind, value in fields:
        wire_kind = (1 if value else 2) if kind == 1 else kind
        out += bytes([(field_id - last) << 4 | wire_kind]) if 0 < field_id - last <= 15 else bytes([wire_kind]) + _zigzag(field_id)
        last = field_id
        out += _value_bytes(kind, value)
    return bytes(out + b"\x00")


def _value_bytes(kind: int, value: Any, in_list: bool = False) -> bytes:
    if kind == 1:   # bool: in the field's type, a byte in a list
        return bytes([1 if value else 2]) if in_list else b""
    if kind in (5, 6):   # i32, i64
        return _zigzag(value)
    if kind == 7:   # double
        return bytes(8)
    if kind == 8:   # binary
        return _varint(len(value)) + value
    if kind == 9:   # list: (element type, elements)
        element, items = value
        head = bytes([len(items) << 4 | element]) if len(items) < 15 else bytes([0xF0 | element]) + _varint(len(items))
        return head + b"".join(_value_bytes(element, item, True) for item in items)
    if kind == 12:
        return _struct_bytes(value)
    raise AssertionError(kind)


EXTRA_FIELDS = st.lists(st.tuples(st.integers(6, 40), st.one_of(
    st.tuples(st.just(1), st.booleans()), st.tuples(st.just(6), st.integers(-2**63, 2**63 - 1)),
    st.tuples(st.just(7), st.just(0.0)), st.tuples(st.just(8), st.binary(max_size=20)),
    st.tuples(st.just(9), st.tuples(st.just(5), st.lists(st.integers(-2**31, 2**31 - 1), max_size=20))),
    st.tuples(st.just(9), st.tuples(st.just(1), st.lists(st.booleans(), max_size=3))),
    st.tuples(st.just(12), st.lists(st.tuples(st.integers(1, 3), st.just(8), st.binary(max_size=8)), max_size=3)),
)).map(lambda t: (t[0], *t[1])), max_size=5)


@settings(max_examples=200, deadline=None)
@given(sizes=st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1), st.integers(-2**31, 2**31 - 1)),
       values=st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 9), st.integers(0, 9), st.integers(0, 9)),
       with_crc=st.booleans(), extra=EXTRA_FIELDS, nested_extra=EXTRA_FIELDS, data=st.data())
def test_page_headers_read_as_written(sizes: tuple[int, int, int], values: tuple[int, int, int, int], with_crc: bool,
                                      extra: list[tuple[int, int, Any]], nested_extra: list[tuple[int, int, Any]],
                                      data: st.DataObject) -> None:
    """A page header with fields of every kind a writer may add (skipped), in any order: its
    sizes, CRC and data page header read back, the page's bytes found where the header ends; cut
    short anywhere, it is refused (the column chunk is then left to pyarrow)."""
    uncompressed, compressed, crc = sizes
    data_page = data.draw(st.permutations([(i + 1, 5, v) for i, v in enumerate(values)] + nested_extra))
    fields = [(1, 5, 0), (2, 5, uncompressed), (3, 5, compressed), (5, 12, data_page)] + ([(4, 5, crc)] if with_crc else [])
    encoded = _struct_bytes(data.draw(st.permutations(fields + extra)))
    before = b"\x07" * data.draw(st.integers(0, 3))
    header, end = read_page_header(memoryview(before + encoded + b"\x99"), len(before))
    assert end == len(before) + len(encoded)
    assert (header.type, header.uncompressed_page_size, header.compressed_page_size) == (0, uncompressed, compressed)
    assert header.crc == (crc if with_crc else None)
    assert header.data_page_header == values
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(pages_module._NotDecoded):
        read_page_header(memoryview(before + encoded[:cut]), len(before))


def test_written_files_have_many_pages() -> None:
    """The property above covers column chunks of many pages (the writer options it draws work)."""
    docs = [[list(range(i, i + 50))] for i in range(40)]
    data = chunk_bytes(docs, np.uint16, 10_000, data_page_size=64, write_batch_size=16)
    assert num_pages(data, 0) > 20
    assert np.array_equal(decoded(data, 0), pyarrow_tokens(pq.ParquetFile(io.BytesIO(data)), 0))


def corrupt_page_bytes(data: bytes, seed: int) -> list[bytes]:
    """Copies of ``data`` with one bit flipped in the compressed bytes of one of the tokens' pages."""
    column = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0).column(1)
    start, stop = column.data_page_offset, column.data_page_offset + column.total_compressed_size
    payloads = [i for i in range(start, stop) if data[i:i + 4] == ZSTD_MAGIC]
    rng = np.random.default_rng(seed)
    out = []
    for page in payloads:
        end = next((p for p in payloads if p > page), stop)
        offset = int(rng.integers(page, end))
        out.append(data[:offset] + bytes([data[offset] ^ (1 << int(rng.integers(8)))]) + data[offset + 1:])
    return out


def test_a_damaged_page_fails_its_crc_as_pyarrow_says() -> None:
    """A flipped bit in any token page is PageChecksumError, worded exactly as pyarrow's checked read
    (so ``unreadable_chunk`` tells the user the same), never tokens."""
    docs = [[[(i * 7919 + j) % 65536 for j in range(200)]] for i in range(30)]
    data = chunk_bytes(docs, np.uint16, 10_000, data_page_size=1024, write_batch_size=64)
    damaged = corrupt_page_bytes(data, seed=3)
    assert len(damaged) > 3
    for copy in damaged:
        with pytest.raises(OSError, match="CRC checksum verification failed") as pyarrow_error:
            open_chunk(pa.BufferReader(copy)).read_row_group(0, columns=[TOKENS_COLUMN])
        with pytest.raises(PageChecksumError) as error:
            decoded(copy, 0, count=30 * 200)
        assert str(error.value) == str(pyarrow_error.value)


def test_pages_without_checksums_decode() -> None:
    """Chunks written before page checksums (no CRC in their headers) decode here too."""
    docs = [[[i, i + 1, 65535]] for i in range(100)]
    data = chunk_bytes(docs, np.uint16, 10_000, write_page_checksum=False, data_page_size=100)
    assert np.array_equal(decoded(data, 0), pyarrow_tokens(pq.ParquetFile(io.BytesIO(data)), 0))


OTHER_LAYOUTS = {
    "dictionary": dict(use_dictionary=True),
    "snappy": dict(compression="snappy", compression_level=None),
    "data pages v2": dict(data_page_version="2.0"),
    "delta encoding": dict(column_encoding={"tokens.list.element": "DELTA_BINARY_PACKED"}),
}


@pytest.mark.parametrize("writer", OTHER_LAYOUTS.values(), ids=OTHER_LAYOUTS.keys())
def test_other_layouts_are_left_to_pyarrow(writer: dict[str, object]) -> None:
    """A column chunk stored in a way not decoded here is None (the caller then reads it with pyarrow)."""
    docs = [[[i % 300, 7, i]] for i in range(200)]
    assert decoded(chunk_bytes(docs, np.uint16, 10_000, **writer), 0) is None


def test_nulls_and_wide_types_are_left_to_pyarrow() -> None:
    """Null tokens are not stored, so fewer values than the lists' four slots: None (pyarrow then
    reads the nulls, which ChunkFiles refuses as before); INT64 values: None."""
    table = pa.table({TOKENS_COLUMN: pa.array([[1, None, 3], [4]], pa.large_list(pa.uint16()))})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", use_dictionary=False)
    assert decoded(sink.getvalue(), 0, count=4) is None
    wide = pa.table({TOKENS_COLUMN: pa.array([[1, 2, 3], [4]], pa.large_list(pa.int64()))})
    sink = io.BytesIO()
    pq.write_table(wide, sink, compression="zstd", use_dictionary=False)
    assert decoded(sink.getvalue(), 0, count=4) is None


@pytest.fixture(scope="module")
def lake_config(lakes: Lakes, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' small shared lake, read with a full shuffle and a cache too small to keep a row group."""
    spec = small_lake_request()
    shared = lakes.shared(spec.pop("corpus"), spec.pop("datasets"), **spec)
    config = yaml.safe_load(shared.read_text())
    config["loader"] = {"seq_len": 64, "batch_size": 8, "shuffle": "full", "prefetch": 0, "cache_bytes": "1KB"}
    path = tmp_path_factory.mktemp("pages") / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def counting(monkeypatch: pytest.MonkeyPatch, force_pyarrow: bool) -> list[bool]:
    """Patches ChunkFiles' page decoder to record whether each call decoded (and, with
    ``force_pyarrow``, to leave every row group to pyarrow)."""
    calls: list[bool] = []
    real = read_column_ranges

    def spy(*args: object) -> list[np.ndarray] | None:
        values = None if force_pyarrow else real(*args)  # type: ignore[arg-type]
        calls.append(values is not None)
        return values

    monkeypatch.setattr(chunks_module, "read_column_ranges", spy)
    return calls


def test_loader_batches_equal_with_pyarrow_fallback(lake_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shuffled Loader's batches (its cache too small to keep a row group: every one decoded again
    and again) are bitwise the same whether the tokens' pages are decoded here or by pyarrow."""
    fast_calls = counting(monkeypatch, force_pyarrow=False)
    loader = Loader(lake_config)
    steps = range(min(loader.num_batches() or 30, 30))
    fast = [loader.batch(s) for s in steps]
    loader.close()
    assert len(fast_calls) > 30 and all(fast_calls), fast_calls   # every row group decoded here
    slow_calls = counting(monkeypatch, force_pyarrow=True)
    loader = Loader(lake_config)
    slow = [loader.batch(s) for s in steps]
    loader.close()
    assert len(slow_calls) > 30 and not any(slow_calls)
    assert_batches_equal(fast, slow, "pages vs pyarrow", steps)


def test_files_of_other_layouts_read_the_same(built_lake: Path) -> None:
    """A chunk file stored otherwise (dictionary-encoded here) reads through ChunkFiles to the same
    row group, by pyarrow (its check against the catalog, sha256 included, passed before it was
    rewritten: with ``verify: size`` a file whose pages are left to pyarrow is hashed first)."""
    lake = open_lake(built_lake)   # a private copy of the small lake
    view = CatalogView(lake)
    chunks = view.dataset("d")
    files = ChunkFiles(lake, "checksum", 0, 0)
    expected = files.read_row_group(chunks, 0, 0)
    path = Path(lake.path_of(chunks.record(0).path))
    table = pq.read_table(path)
    with pq.ParquetWriter(path, table.schema, compression="zstd", use_dictionary=True, store_schema=True,
                          write_page_checksum=True) as writer:
        writer.write_table(table)
    assert decoded(path.read_bytes(), 0) is None
    got = files.read_row_group(chunks, 0, 0)
    view.close()
    assert got.values.dtype == expected.values.dtype and np.array_equal(got.values, expected.values)
    assert np.array_equal(got.parts.part_lengths, expected.parts.part_lengths)


def test_damaged_token_page_message_is_unchanged(built_lake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The error for a chunk whose token page fails its CRC is the same word for word whether the
    pages are decoded here or by pyarrow (the file damaged after its hash passed: with ``verify:
    size`` a file whose pages are left to pyarrow is hashed first)."""
    lake = open_lake(built_lake)   # a private copy of the small lake
    view = CatalogView(lake)
    chunks = view.dataset("d")
    files = ChunkFiles(lake, "checksum", 0, 0)
    files.read_row_group(chunks, 0, 0)
    path = Path(lake.path_of(chunks.record(0).path))
    path.write_bytes(corrupt_page_bytes(path.read_bytes(), seed=5)[0])
    messages = []
    for force_pyarrow in (False, True):
        calls = counting(monkeypatch, force_pyarrow)
        with pytest.raises(ChunkIntegrityError, match="a page failed its CRC-32 checksum") as error:
            files.read_row_group(chunks, 0, 0)
        if not force_pyarrow:
            assert calls == [True, True]   # the part columns decoded; the tokens' decoder raised (returned nothing)
        messages.append(str(error.value))
    view.close()
    assert messages[0] == messages[1]
