"""The ``documents`` view: one row per document of the lake's committed chunks, for SQL.

A sandboxed catalog connection (``connect_reader``) cannot read files, so the files are fed to it
from Python, each checked against its size and sha256 in the catalog first and every page against
its CRC-32 when read, as the loader reads chunks. Per dataset: a pyarrow Dataset over the
documents index files holding its chunks' rows (``ingest/document_index.py``), joined to each
chunk's source, first line and the source's file name (which ``doc_key`` hashes) by position in
lists; and for its committed chunks the index does not hold, a pyarrow Dataset over their chunk
files with those values as per-file constant columns. Both give the same rows. DuckDB pushes
projections and filters into the scans, so a query reads only the columns it needs (never the
tokens). The user's SQL can reach these files and no other.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from lakeloader.catalog.hash_records import HashRecords
from lakeloader.catalog.location import LakeLocation
from lakeloader.catalog.sql import query
from lakeloader.contracts.chunk_file import (
    KIND_TOKENS_PREFIX,
    META_PREFIX,
    PART_KINDS_COLUMN,
    PART_LENGTHS_COLUMN,
    RECORD_COLUMN,
    altered_chunk,
    missing_chunk,
    sha256_mismatch,
    size_mismatch,
    unreadable_chunk,
)
from lakeloader.contracts.doc_keys import key_name
from lakeloader.contracts.errors import CatalogError, CatalogIntegrityError, LakeloaderError
from lakeloader.contracts.selection import PREDICATE_COLUMNS, PredicateError, check_predicate
from lakeloader.storage import with_retries

log = logging.getLogger(__name__)

VIEW = "documents"
_MENTION = re.compile(rf"\b{VIEW}\b", re.IGNORECASE)
_CHUNK_COLUMNS = (RECORD_COLUMN, PART_LENGTHS_COLUMN, PART_KINDS_COLUMN)
# Per-file constants: (name, type) of the columns each chunk file's rows get from the catalog.
_FILE_COLUMNS = (("dataset", pa.string()), ("chunk", pa.int64()), ("source", pa.string()), ("line_base", pa.int64()),
                 ("key_name", pa.string()))
HISTOGRAM_BINS_PER_OCTAVE = 4


def mentions_documents(statement: str) -> bool:
    """Whether ``statement`` may read the documents view (then it is registered first; other
    queries never open a chunk file)."""
    return _MENTION.search(statement) is not None


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# Chunk files of a remote lake downloaded (and hashed) side by side, and what is read at once of one.
_CHECKING_THREADS = 8
_BLOCK = 8 << 20
_COPIES = "documents"   # in the lake's cache folder: a remote lake's verified copies, per query


class _FileRecord(NamedTuple):
    dataset: str
    global_index: int    # of a chunk file; -1: a documents index file
    path: str
    num_bytes: int
    checksum: str


def _where(lake: LakeLocation, row: _FileRecord) -> str:
    if row.global_index < 0:
        return f"documents index file {lake.url_of(row.path)} of dataset {row.dataset!r}"
    return f"chunk {row.global_index} of dataset {row.dataset!r} ({lake.url_of(row.path)})"


_INDEX_TODO = ("run `lakeloader build CONFIG`: it forgets the index files that are missing or of the wrong "
               "size (delete a damaged one first), and the documents view reads those chunks' files")


def _missing(lake: LakeLocation, row: _FileRecord) -> LakeloaderError:
    if row.global_index < 0:
        return CatalogIntegrityError(f"{_where(lake, row)} is missing: {_INDEX_TODO}")
    return missing_chunk(_where(lake, row))


def _altered(lake: LakeLocation, row: _FileRecord, problem: str) -> LakeloaderError:
    if row.global_index < 0:
        return CatalogIntegrityError(f"{_where(lake, row)} is corrupt: it {problem}. Never read as data: {_INDEX_TODO}")
    return altered_chunk(_where(lake, row), problem)


def _check_local(lake: LakeLocation, records: HashRecords, row: _FileRecord) -> str:
    """The lake's file ``row`` (a chunk file, a row of ``document_chunks``, or an index file),
    checked against its record as the loader checks a chunk: its size, and its sha256 (hashed
    once per machine while the file is unchanged)."""
    path = lake.path_of(row.path)
    try:
        handle = pa.OSFile(path)
    except FileNotFoundError:
        raise _missing(lake, row) from None
    with handle:
        if handle.size() != row.num_bytes:
            raise _altered(lake, row, f"has {size_mismatch(handle.size(), row.num_bytes)}")
        digest = records.sha256(path, handle, row.checksum)
    if digest != row.checksum:
        raise _altered(lake, row, f"has {sha256_mismatch(digest, row.checksum)}")
    return path


def _download_checked(lake: LakeLocation, folder: str, row: _FileRecord) -> str:
    """A local copy (in ``folder``) of the remote lake's file ``row``, hashed as it is written:
    what the view reads is what was hashed."""
    local = os.path.join(folder, f"{row.global_index}-{row.path.replace('/', '__')}")

    def download() -> tuple[int, str]:
        digest, size = hashlib.sha256(), 0
        with lake.fs.open(lake.path_of(row.path), "rb") as source, open(local, "wb") as sink:
            while size <= row.num_bytes and (block := source.read(_BLOCK)):   # (never much past its size)
                digest.update(block)
                sink.write(block)
                size += len(block)
        return size, digest.hexdigest()

    try:
        size, digest = with_retries(download, what=f"reading {_where(lake, row)}", deadline=lake.io_retry_deadline)
    except FileNotFoundError:
        raise _missing(lake, row) from None
    if size != row.num_bytes:
        more = "more than " if size > row.num_bytes else ""
        raise _altered(lake, row, f"has {more}{size_mismatch(size, row.num_bytes)}")
    if digest != row.checksum:
        raise _altered(lake, row, f"has {sha256_mismatch(digest, row.checksum)}")
    return local


def _copies_folder(lake: LakeLocation) -> str:
    """A new folder for one dataset's copies of a remote lake's chunk files (the folders of
    processes that ended without removing theirs removed first)."""
    parent = os.path.join(lake.cache_dir, _COPIES)
    os.makedirs(parent, exist_ok=True)
    for name in os.listdir(parent):
        owner = name.split("-", 1)[0]
        if owner.isdigit() and not _running(int(owner)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=parent)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # (another user's)
        return True
    return True


def _checked_paths(lake: LakeLocation, chunks: pd.DataFrame) -> tuple[list[str], str | None]:
    """The files the view reads for ``chunks`` (rows of ``document_chunks``, or of index files
    with global_index -1), each checked first against its catalog record as the loader checks a
    chunk (ChunkIntegrityError naming the first chunk that is not as built, or gone;
    CatalogIntegrityError for an index file), and the folder holding them if they are copies (a
    remote lake's: downloaded whole, the price of checking a file read there; the loader's disk
    cache belongs to the read layer above this one). Every file is checked, whatever a query's
    filter later rules out: the scan cannot check a file as it opens it."""
    rows = [_FileRecord(*values) for values in zip(chunks.dataset.tolist(), chunks.global_index.tolist(),
                                                    chunks.path.tolist(), chunks.num_bytes.tolist(),
                                                    chunks.checksum.tolist())]
    if lake.is_local:   # (each file vouched for by its record in microseconds, else hashed: no threads)
        records = HashRecords(lake.cache_dir)
        return [_check_local(lake, records, row) for row in rows], None
    folder = _copies_folder(lake)
    check = functools.partial(_download_checked, lake, folder)
    pool = concurrent.futures.ThreadPoolExecutor(min(_CHECKING_THREADS, len(rows)) or 1)
    try:
        return list(pool.map(check, rows)), folder   # (the first failure in chunk order raises)
    except BaseException:
        pool.shutdown(cancel_futures=True)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        pool.shutdown()


def _relation(lake: LakeLocation, files: pd.DataFrame, schema_of: Callable[[pa.Schema], pa.Schema],
              partitions: list[ds.Expression] | None = None) -> ds.Dataset:
    """A pyarrow Dataset over ``files`` (rows as :func:`_checked_paths` takes them), each checked
    against its catalog record first, with the schema ``schema_of`` makes of the first file's
    (and ``partitions``: each file's constant columns).

    The files are local ones, a local lake's or copies of a remote lake's: no Python runs in the
    scan, where pyarrow's threads calling back into Python deadlocked against DuckDB's thread
    holding the GIL."""
    paths, copies = _checked_paths(lake, files)
    filesystem = pafs.LocalFileSystem()
    first = files.iloc[0]
    try:
        with filesystem.open_input_file(paths[0]) as handle:
            file_schema = pq.read_schema(handle)
    except (OSError, pa.ArrowException) as exc:
        if copies is not None:
            shutil.rmtree(copies, ignore_errors=True)
        where = _where(lake, _FileRecord(first.dataset, int(first.global_index), first.path, 0, ""))
        if first.global_index < 0:
            raise CatalogIntegrityError(f"{where} is corrupt: it cannot be decoded ({exc}). {_INDEX_TODO}") from exc
        raise unreadable_chunk(where, exc) from exc
    scan = ds.ParquetFragmentScanOptions(page_checksum_verification=True)
    dataset = ds.FileSystemDataset.from_paths(
        paths, schema=schema_of(file_schema), format=ds.ParquetFileFormat(default_fragment_scan_options=scan),
        filesystem=filesystem, partitions=partitions)
    if copies is not None:   # removed once the connection the view is registered on lets go of it
        weakref.finalize(dataset, shutil.rmtree, copies, True)
    return dataset


def _dataset_relation(lake: LakeLocation, chunks: pd.DataFrame) -> ds.Dataset:
    """A pyarrow Dataset over one dataset's committed chunk files with their per-file constants
    (:func:`_relation`). Its schema is that of the first file: the metadata columns and their
    types are the same in every chunk of a dataset plan (declared in the config and part of the
    chunk folder's name)."""
    def schema_of(file_schema: pa.Schema) -> pa.Schema:
        fields = [file_schema.field(name) for name in _CHUNK_COLUMNS]
        fields += [field for field in file_schema if field.name.startswith(META_PREFIX)]
        return pa.schema(fields + [pa.field(name, kind) for name, kind in _FILE_COLUMNS])

    partitions = []
    for row in chunks.itertuples(index=False):
        line_base = None if pd.isna(row.line_base) else int(row.line_base)
        partitions.append((ds.field("dataset") == row.dataset) & (ds.field("chunk") == int(row.global_index))
                          & (ds.field("source") == row.source)
                          & (ds.field("line_base") == pa.scalar(line_base, pa.int64()))
                          & (ds.field("key_name") == key_name(row.source)))
    return _relation(lake, chunks, schema_of, partitions)


def _chunk_constants(chunks: pd.DataFrame) -> pa.Table:
    """The per-chunk constants (``_FILE_COLUMNS``) of ``chunks`` (rows of ``document_chunks``),
    one row per global index from their lowest to their highest (``covered``: one of ``chunks``)."""
    indices = chunks.global_index.astype("int64").to_numpy()
    first = int(indices.min())
    at = indices - first
    size = int(indices.max()) - first + 1
    covered = np.zeros(size, bool)
    covered[at] = True
    sources = np.full(size, None, object)
    sources[at] = chunks.source.to_numpy(object)
    names = np.full(size, None, object)
    names[at] = chunks.source.map({source: key_name(source) for source in chunks.source.unique()}).to_numpy(object)
    line_bases = np.zeros(size, np.int64)
    known = chunks.line_base.notna().to_numpy()
    line_bases[at[known]] = chunks.line_base[known].astype("int64").to_numpy()
    valid = np.zeros(size, bool)
    valid[at[known]] = True
    return pa.table({
        "dataset": pa.array(np.full(size, chunks.dataset.iloc[0], object), pa.string()),
        "chunk": pa.array(np.arange(first, first + size, dtype=np.int64)),
        "covered": pa.array(covered),
        "source": pa.array(sources, pa.string()),
        "line_base": pa.array(line_bases, mask=~valid),
        "key_name": pa.array(names, pa.string()),
    })


def _dataset_select(relation: str, fields: list[str], schema: pa.Schema, chunks: str | None = None,
                    every: bool = False) -> str:
    """The documents view's select of one dataset's chunk files (``relation``), or with
    ``chunks`` (the relation of their constants) of its index files (``every``: it answers for
    every chunk they hold)."""
    indexed = chunks is not None
    columns = [query("documents_index_kind_tokens").format(column=f"i.{_quoted(KIND_TOKENS_PREFIX + str(kind))}",
                                                           name=_quoted(f"tokens_{name}")) if indexed else
               query("documents_kind_tokens").format(kind=kind, name=_quoted(f"tokens_{name}"))
               for kind, name in enumerate(fields)]
    columns += [query("documents_metadata").format(column=("i." if indexed else "") + _quoted(field.name),
                                                   name=_quoted(field.name.removeprefix(META_PREFIX)))
                for field in schema if field.name.startswith(META_PREFIX)]
    listed = "".join(f",\n       {column}" for column in columns)
    if indexed:
        where = "" if every else "\n" + query("documents_of_index_covered")
        return query("documents_of_index").format(source=relation, chunks=chunks, columns=listed, where=where)
    return query("documents_of_dataset").format(source=relation, columns=listed)


def _stored_predicate(con: duckdb.DuckDBPyConnection, name: str, where: str, schema: pa.Schema) -> str:
    """The predicate the catalog stores for the filtered dataset ``name``, checked as strictly as
    the config's ``where`` against the metadata fields of its chunk files (``schema``) and
    ``num_tokens``, as DuckDB prints it back (it cannot end its parentheses in the view). The
    catalog is a file of the lake, so a CatalogError names it and the dataset if it is refused."""
    columns = {field.name.removeprefix(META_PREFIX): field.type for field in schema if field.name.startswith(META_PREFIX)}
    try:
        return check_predicate(where, {**columns, **PREDICATE_COLUMNS})
    except PredicateError as exc:
        row = con.execute(query("attached_catalog_path")).fetchone()
        shown = " ".join(where.split())
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CatalogError(
            f"catalog {row[0] if row else 'of the lake'}: the predicate it stores for dataset {name!r} "
            f"({shown!r}) is refused: {exc}. lakeloader stores the where of the config, checked; this one was "
            "altered by hand or by other software: rebuild the lake from its config (lakeloader build "
            "CONFIG into a new lake) or read only lakes from people you trust") from None


def _document_chunks(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """The rows of ``document_chunks``, with the index file holding each chunk's rows (None where
    none does, and on a catalog without the documents index)."""
    if con.execute(query("has_document_index")).fetchone()[0]:
        return con.execute(query("document_chunks").format(
            index_file="x.path", index_join="\n" + query("document_chunks_index_join"))).df()
    return con.execute(query("document_chunks").format(index_file="NULL::VARCHAR", index_join="")).df()


def _index_files(con: duckdb.DuckDBPyConnection, paths: list[str]) -> pd.DataFrame:
    """The records of index files ``paths`` as :func:`_checked_paths` takes them."""
    files = con.execute(query("document_index_files_of"), {"paths": paths}).df()
    return files.assign(global_index=-1)[["dataset", "global_index", "path", "num_bytes", "checksum", "num_chunks"]]


def register_documents(con: duckdb.DuckDBPyConnection, lake: LakeLocation,
                       datasets: Sequence[str] | None = None) -> None:
    """Define the ``documents`` view on ``con`` (a catalog connection of ``lake``) over the lake's
    committed chunks (of ``datasets`` only, if given): one row per document with
    ``DOCUMENT_COLUMNS``, ``tokens_<kind>`` per part kind of its dataset's format and one column per
    metadata field (NULL where a dataset lacks it). A dataset defined by a filter has the documents
    its predicate selects, numbered as its loader numbers them. Chunks committed after the catalog
    ``con`` reads was published are not in it. The rows of chunks the documents index holds come
    from its files, the others' from the chunk files: the same rows either way."""
    chunks = _document_chunks(con)
    if datasets is not None:
        chunks = chunks[chunks.dataset.isin(datasets)]
    plans = {name: (list(fields), where) for name, fields, where in con.execute(query("document_datasets")).fetchall()}
    selects = []
    number = 0
    for name, group in chunks.groupby("dataset", sort=True):
        fields, where = plans[name]
        indexed = group.index_file.notna()
        parts = []
        if indexed.any():
            relation, constants = f"documents_index_{number}", f"documents_index_chunks_{number}"
            files = _index_files(con, sorted(set(group.index_file[indexed])))
            dataset = _relation(lake, files, lambda schema: schema)
            con.register(relation, dataset)
            con.register(constants, _chunk_constants(group[indexed]))
            every = int(files.num_chunks.sum()) == int(indexed.sum())   # (no chunk of the files left out)
            parts.append((_dataset_select(relation, fields, dataset.schema, constants, every), dataset.schema))
            number += 1
        if not indexed.all():
            relation = f"documents_of_dataset_{number}"
            dataset = _dataset_relation(lake, group[~indexed])
            con.register(relation, dataset)
            parts.append((_dataset_select(relation, fields, dataset.schema), dataset.schema))
            number += 1
        for select, schema in parts:
            if isinstance(where, str):   # a dataset defined by a filter: its chunk files are its source's
                select = query("documents_of_filtered_dataset").format(
                    select=select, where=_stored_predicate(con, name, where, schema))
            selects.append(select)
        log.debug("documents view: dataset %r, %d committed chunks (%d from the documents index)",
                  name, len(group), int(indexed.sum()))
    body = "\nUNION ALL BY NAME\n".join(selects) if selects else query("documents_empty")
    con.execute(query("documents_view").format(selects=body))


def scan_failure(exc: duckdb.Error) -> LakeloaderError | None:
    """The clear error for a failure reading a chunk file through the documents view (a page that
    fails its checksum, a file that cannot be decoded or is gone); None for any other error."""
    text = str(exc)
    if "CRC checksum verification failed" in text or "Couldn't deserialize thrift" in text:
        return unreadable_chunk("a chunk file read by the documents view (`lakeloader verify CONFIG` names it)", exc)
    if "No such file" in text or "FileNotFoundError" in text:
        return CatalogError(f"a chunk file read by the documents view is missing ({text}); "
                            "`lakeloader verify CONFIG --repair` rebuilds it")
    return None


def view_columns(con: duckdb.DuckDBPyConnection) -> list[str]:
    """The columns of the documents view registered on ``con``."""
    return [row[0] for row in con.execute(f"DESCRIBE {VIEW}").fetchall()]


def check_by(con: duckdb.DuckDBPyConnection, by: str | None) -> list[str]:
    """The grouping columns of document statistics: dataset, then ``by`` (a column of the view)."""
    if by is None or by == "dataset":
        return ["dataset"]
    columns = view_columns(con)
    if by not in columns:
        raise CatalogError(f"--by {by}: the documents view has no column {by!r}; choose one of "
                           f"{', '.join(columns)} (metadata fields come from datasets.<name>.metadata_fields)")
    return ["dataset", by]


def document_stats(con: duckdb.DuckDBPyConnection, by: str | None = None) -> pd.DataFrame:
    """Documents, tokens and document-length percentiles (p50, p90, p99, max; in tokens) per
    dataset, or per dataset and value of ``by``, over the documents view registered on ``con``.
    pXX is the shortest length that at least XX% of the group's documents do not exceed."""
    groups = ", ".join(_quoted(name) for name in check_by(con, by))
    return con.execute(query("document_stats").format(by=groups)).df()


def image_stats(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Per dataset storing its images: image occurrences, distinct images, the occurrences' bytes,
    and percentiles of width, height, pixels and bytes (a frame without rows when there are none)."""
    return con.execute(query("image_stats")).df()


def length_histogram(con: duckdb.DuckDBPyConnection, by: str | None = None) -> pd.DataFrame:
    """Documents per length bin of each dataset (and value of ``by``): bin ``b`` holds lengths in
    [2^(b/4), 2^((b+1)/4)) tokens; a few hundred rows, whatever the number of documents."""
    groups = check_by(con, by)
    value = _quoted(groups[1]) if len(groups) > 1 else "NULL"
    return con.execute(query("document_length_histogram").format(
        value=value, per_octave=HISTOGRAM_BINS_PER_OCTAVE)).df()


class DocumentLengths(NamedTuple):
    """Document statistics (:func:`document_stats`) and the length histogram
    (:func:`length_histogram`) of the same documents, grouped alike."""

    stats: pd.DataFrame
    histogram: pd.DataFrame
