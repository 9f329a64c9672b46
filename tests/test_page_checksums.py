"""Chunk pages carry CRC-32 checksums checked on every read: a flipped bit anywhere in a chunk's
token pages is an error naming the chunk, in every verify mode, never different tokens."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.contracts.chunk_file import PART_KINDS_COLUMN, PART_LENGTHS_COLUMN, RECORD_COLUMN, TOKENS_COLUMN
from lakeloader.contracts.errors import ChunkIntegrityError, InputError
from lakeloader.feed.loader import Loader
from lakeloader.ingest.chunk import plan_committed_chunk
from lakeloader.ingest.driver import build
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.chunks import ChunkFiles, RowGroup, RowGroupCache
from lakeloader.read.disk_cache import DiskCache

from conftest import Lakes, stdlib_texts, write_config

SEQ_LEN = 32
BATCH = 4
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"   # first bytes of a zstd frame: where a page's compressed data starts


@pytest.fixture(scope="module")
def lake_root(lakes: Lakes) -> Path:
    """A built lake of one dataset ``d`` with chunks of a few row groups each (never modified)."""
    texts = stdlib_texts("json") + stdlib_texts("email", limit=3)
    return lakes.shared({"d.jsonl": [p for text in texts for p in text.split("\n\n") if p.strip()]},
                        {"d": {"sources": ["d.jsonl"]}}, build={"split_size": "8KB", "row_group_tokens": 400}).parent


def copy_lake(root: Path, out: Path, **loader: object) -> Path:
    """A config reading a fresh copy of the lake (in ``out``) with ``loader`` settings."""
    shutil.copytree(root / "lake", out / "lake")
    config = yaml.safe_load((root / "config.yaml").read_text())
    config["lake"] = str(out / "lake")
    config["loader"] = {"seq_len": SEQ_LEN, "batch_size": BATCH, "shuffle": "none", "prefetch": 0, **loader}
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def target_chunk(lake: Lake, chunks: DatasetChunks) -> int:
    """An early chunk (not the first) with at least two row groups."""
    groups = [pq.ParquetFile(lake.path_of(p)).metadata.num_row_groups for p in (chunks.record(i).path for i in range(chunks.committed))]
    candidates = [i for i, n in enumerate(groups) if n >= 2]
    assert candidates, groups
    return candidates[min(1, len(candidates) - 1)]


def token_page_ranges(path: str, name: str = TOKENS_COLUMN) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Byte ranges of column ``name`` in each row group of a chunk file: the whole column chunks
    (page headers included) and the compressed page data only (from the Parquet metadata)."""
    data = Path(path).read_bytes()
    metadata = pq.ParquetFile(path).metadata
    whole, payload = [], []
    for g in range(metadata.num_row_groups):
        row_group = metadata.row_group(g)
        [column] = [row_group.column(i) for i in range(row_group.num_columns)
                    if row_group.column(i).path_in_schema.split(".")[0] == name]
        assert not column.has_dictionary_page and column.compression == "ZSTD"
        start = column.data_page_offset
        stop = start + column.total_compressed_size
        assert data[start:stop].count(ZSTD_MAGIC) == 1   # one data page per column chunk
        whole.append((start, stop))
        payload.append((start + data[start:stop].index(ZSTD_MAGIC), stop))
    return whole, payload


def steps_of(chunks: DatasetChunks, index: int) -> range:
    """The steps whose batches hold tokens of chunk ``index`` (concat packing, no shuffling: rows
    are the token stream, one EOS after each document, cut every SEQ_LEN tokens)."""
    lengths = chunks.num_tokens + chunks.num_docs
    start, stop = int(lengths[:index].sum()), int(lengths[:index + 1].sum())
    return range(start // SEQ_LEN // BATCH, (stop - 1) // SEQ_LEN // BATCH + 1)


def random_positions(ranges: list[tuple[int, int]], count: int, seed: int) -> list[tuple[int, int]]:
    """``count`` distinct (byte offset, bit) pairs inside ``ranges``."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([np.arange(a, b) for a, b in ranges])
    chosen = rng.choice(len(offsets), size=min(count, len(offsets)), replace=False)
    return [(int(offsets[i]), int(rng.integers(8))) for i in chosen]


def flip(path: Path, offset: int, bit: int) -> None:
    """Flip one bit of a file in place (same size, so ``verify: size`` still passes)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ (1 << bit)]))


def read_all(files: ChunkFiles, chunks: DatasetChunks, index: int, groups: int) -> Iterator[RowGroup]:
    for group in range(groups):
        yield files.row_group(chunks, index, group)


def same(a: RowGroup, b: RowGroup) -> bool:
    return (np.array_equal(a.values, b.values) and np.array_equal(a.parts.part_lengths, b.parts.part_lengths)
            and np.array_equal(a.parts.part_kinds, b.parts.part_kinds))


@pytest.mark.parametrize("mode", ["size", "checksum"])
def test_every_bit_flip_in_token_pages_is_an_error_naming_the_chunk(lake_root: Path, tmp_path: Path,
                                                                    mode: str) -> None:
    """(a) ``verify: size`` never hashes the file; (b) the default mode hashes it once per process:
    here the file is altered after this process verified it. Either way, every flip in the tokens
    column's page data raises ChunkIntegrityError naming the chunk, and a flip anywhere in the
    column chunk (page headers too) never yields different tokens."""
    config = copy_lake(lake_root, tmp_path, verify=mode)
    lake = open_lake(config)
    view = CatalogView(lake)
    chunks = view.dataset("d")
    index = target_chunk(lake, chunks)
    path = Path(lake.path_of(chunks.record(index).path))
    pristine = path.read_bytes()
    groups = pq.ParquetFile(path).metadata.num_row_groups
    expected = list(read_all(ChunkFiles(lake, "checksum", 2**30, 0), chunks, index, groups))
    whole, payload = token_page_ranges(str(path))
    cases = [(p, True) for p in random_positions(payload, 40, seed=1)]
    cases += [(p, False) for p in random_positions(whole, 20, seed=2)]
    errors = 0
    for (offset, bit), in_page_data in cases:
        path.write_bytes(pristine)
        files = ChunkFiles(lake, mode, 2**30, 0)
        if mode == "checksum":
            list(read_all(files, chunks, index, groups))   # verified (hashed) while intact...
            files.cache = RowGroupCache(2**30)             # ...and its decoded row groups since evicted
        flip(path, offset, bit)
        try:
            got = list(read_all(files, chunks, index, groups))
        except ChunkIntegrityError as exc:
            errors += 1
            message = str(exc)
            assert f"chunk {index} of dataset 'd'" in message and str(path) in message, message
            assert "lakeloader verify CONFIG --repair" in message, message
            continue
        assert not in_page_data, f"flip of bit {bit} at byte {offset} decoded without an error"
        assert all(same(a, b) for a, b in zip(got, expected)), f"bit {bit} at byte {offset}: different tokens"
    assert errors >= 40
    view.close()


def test_loader_never_returns_altered_tokens(lake_root: Path, tmp_path: Path) -> None:
    """Through the Loader, in the default mode: a chunk altered after this process verified and read
    it makes the batches that need it fail with an error naming it (the issue's case (b)), and a
    fresh ``verify: size`` loader fails the same way (case (a))."""
    config = copy_lake(lake_root, tmp_path, cache_bytes="1KB")
    loader = Loader(config)
    chunks = loader.view.dataset("d")
    index = target_chunk(loader.lake, chunks)
    path = Path(loader.lake.path_of(chunks.record(index).path))
    steps = steps_of(chunks, index)
    assert all(str(chunks.record(index).path) in set(loader.explain(s).chunk_path) for s in (steps[0], steps[-1]))
    for s in steps:
        loader.batch(s)
    for s in range(steps[-1] + 1, steps[-1] + 4):   # evicts the chunk's row groups from the small cache
        loader.batch(s)
    _, payload = token_page_ranges(str(path))
    for n, page in enumerate(payload):   # one flipped bit in each of its row groups' token pages
        [(offset, bit)] = random_positions([page], 1, seed=n)
        flip(path, offset, bit)
    for step in steps:
        with pytest.raises(ChunkIntegrityError, match=f"chunk {index} of dataset 'd'") as error:
            loader.batch(step)
        assert "CRC" in str(error.value) and "lakeloader verify CONFIG --repair" in str(error.value)
    loader.close()
    fresh = copy_lake(lake_root, tmp_path / "size", verify="size")
    shutil.copyfile(path, tmp_path / "size" / "lake" / chunks.record(index).path)
    sized = Loader(fresh)
    with pytest.raises(ChunkIntegrityError, match=f"chunk {index} of dataset 'd'"):
        for step in steps:
            sized.batch(step)
    sized.close()


def test_chunks_written_without_page_checksums_still_read(lake_root: Path, tmp_path: Path) -> None:
    """Chunk files written before page checksums (no CRC in their page headers) read as before."""
    from lakeloader.contracts.chunk_file import open_chunk

    lake = open_lake(lake_root / "config.yaml")
    chunks = CatalogView(lake).dataset("d")
    index = target_chunk(lake, chunks)
    current = pq.ParquetFile(lake.path_of(chunks.record(index).path))
    table = current.read()
    old = tmp_path / "old.parquet"
    with pq.ParquetWriter(old, table.schema, compression="zstd", compression_level=1, use_dictionary=False,
                          write_statistics=False, store_schema=True) as writer:
        for g in range(current.metadata.num_row_groups):
            writer.write_table(current.read_row_group(g))
    assert old.stat().st_size < Path(lake.path_of(chunks.record(index).path)).stat().st_size   # no CRCs
    reopened = open_chunk(str(old))
    assert reopened.metadata.num_row_groups == current.metadata.num_row_groups
    assert reopened.read().equals(table)


@pytest.mark.parametrize("column", [RECORD_COLUMN, PART_LENGTHS_COLUMN, PART_KINDS_COLUMN])
def test_every_reader_of_a_chunk_checks_its_pages(lake_root: Path, tmp_path: Path, column: str) -> None:
    """Not only token pages: a flipped bit in any column a reader decodes is an error naming the
    chunk (the loader's part layouts, the build's packing counts, ``explain``'s record numbers)."""
    config = copy_lake(lake_root, tmp_path, verify="size")
    loader = Loader(config)
    chunks = loader.view.dataset("d")
    index = target_chunk(loader.lake, chunks)
    path = loader.lake.path_of(chunks.record(index).path)
    step = steps_of(chunks, index)[0]
    assert str(chunks.record(index).path) in set(loader.explain(step).chunk_path)
    _, payload = token_page_ranges(path, column)
    [(offset, bit)] = random_positions(payload[:1], 1, seed=7)
    flip(Path(path), offset, bit)
    named = f"chunk {index} "
    if column == RECORD_COLUMN:
        with pytest.raises(ChunkIntegrityError, match=f"{named}of dataset 'd'.*CRC"):
            loader.explain(step)
    else:
        with pytest.raises(ChunkIntegrityError, match=f"{named}of dataset 'd'.*CRC"):
            ChunkFiles(loader.lake, "size", 2**30, 0).chunk_parts(chunks, index)
        with pytest.raises(ChunkIntegrityError, match=f"{named}.*{chunks.record(index).path}.*CRC"):
            plan_committed_chunk(loader.lake.url_of(chunks.record(index).path), {}, index, ())
        fresh = Loader(config)   # ``loader`` holds the row group decoded by explain() above
        with pytest.raises(ChunkIntegrityError, match=f"{named}of dataset 'd'.*CRC"):
            fresh.batch(step)
        fresh.close()
    loader.close()


def test_damaged_page_of_a_parquet_source_is_an_input_error(tmp_path: Path, dask_scheduler: str) -> None:
    """A Parquet source written with page checksums: a damaged page fails the build naming the file
    and row group, instead of tokenizing altered text into the lake."""
    texts = [p for text in stdlib_texts("json") for p in text.split("\n\n") if p.strip()]
    source = tmp_path / "s.parquet"
    pq.write_table(pa.table({"text": texts}), source, row_group_size=50, write_page_checksum=True,
                   compression="none")
    column = pq.ParquetFile(source).metadata.row_group(1).column(0)
    assert column.has_dictionary_page
    flip(source, (column.dictionary_page_offset + column.data_page_offset) // 2, 3)  # in the dictionary's texts
    config = write_config(tmp_path, {"d": {"sources": [str(source)]}})
    with pytest.raises(InputError, match=f"{source}: row group 1 \\(rows 50-99\\) is corrupt.*CRC"):
        build(config, scheduler=dask_scheduler, progress=False)


def test_damaged_local_copy_of_a_remote_chunk_is_named(lake_root: Path, tmp_path: Path) -> None:
    """A remote lake's chunks are read from local disk-cache copies: a damaged copy is an error naming
    that copy (the lake's file may be intact). The lake here is local, given a real disk cache."""
    config = copy_lake(lake_root, tmp_path, verify="size")
    lake = open_lake(config)
    chunks = CatalogView(lake).dataset("d")
    index = target_chunk(lake, chunks)
    files = ChunkFiles(lake, "size", 2**30, 0)
    files.disk = DiskCache(lake, 2**30)
    files.row_group(chunks, index, 0)
    files.cache = RowGroupCache(2**30)
    copy = files.disk.local_path(chunks.record(index).path)
    _, payload = token_page_ranges(copy)
    [(offset, bit)] = random_positions(payload[:1], 1, seed=11)
    flip(Path(copy), offset, bit)
    with pytest.raises(ChunkIntegrityError, match="CRC") as error:
        files.row_group(chunks, index, 0)
    assert f"local copy {copy}: if `lakeloader verify CONFIG` finds" in str(error.value)
