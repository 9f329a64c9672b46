"""The chunk-file contract between the build and every reader: the columns of a chunk file, how
one is opened (page checksums verified), and what a build task reports for the catalog."""

from __future__ import annotations

import dataclasses
import functools
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lakeloader.contracts.errors import ChunkIntegrityError
from lakeloader.contracts.media import PART_HEIGHTS_COLUMN, PART_WIDTHS_COLUMN

# Columns of a chunk file (one row per document). Tokens are stored without special tokens.
RECORD_COLUMN = "record"              # the document's line/row index from its split's first record
TOKENS_COLUMN = "tokens"              # the contents of all its parts, back to back
PART_LENGTHS_COLUMN = "part_lengths"  # tokens of each part
PART_KINDS_COLUMN = "part_kinds"      # kind of each part (index into dataset_plans.fields)
PART_REFS_COLUMN = "part_refs"        # interleaved only: each image part's reference (null for text)
# A dataset's metadata fields (config key metadata_fields), one column each, named META_PREFIX +
# field, of the field's declared type (never inferred: chunks built in parallel agree on it).
META_PREFIX = "meta."
METADATA_ARROW_TYPES = {"string": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}
# Columns every row of the catalog's ``documents`` view has (then ``tokens_<kind>`` per part kind
# and one per metadata field, which therefore may not take these names).
DOCUMENT_COLUMNS = ("dataset", "chunk", "doc", "source", "line", "doc_key", "num_tokens", "num_parts")
# Columns of a documents index file (one row per document of the chunks it covers, sorted by chunk
# and doc): these, then KIND_TOKENS_PREFIX + kind number per part kind, then the metadata columns
# as the chunk files store them.
INDEX_COLUMNS = ("chunk", "doc", RECORD_COLUMN, "num_tokens", "num_parts")
KIND_TOKENS_PREFIX = "kind_tokens."


def metadata_kind_of(arrow_type: pa.DataType) -> str | None:
    """The metadata field type ("string", "int", "float" or "bool") whose values an Arrow column
    type holds; None for any other type."""
    if pa.types.is_boolean(arrow_type):
        return "bool"
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_floating(arrow_type):
        return "float"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    return None


def metadata_column(field: str) -> str:
    """The chunk-file column of metadata field ``field``."""
    return META_PREFIX + field


@dataclasses.dataclass(frozen=True)
class Reject:
    """One skipped input: where it is and why it was skipped."""

    location: str       # "line 17", "row 3 (row group 0)", "lines 9000-end", ...
    line: int | None    # 1-based line (text/JSONL) or 0-based row (Parquet) where known
    reason: str


@dataclasses.dataclass(frozen=True)
class PlanStats:
    """What the catalog keeps of one chunk's plan."""

    plan_key: str
    num_examples: int
    num_tokens: int             # non-padding tokens of its examples
    truncated_docs: int
    dropped_tokens: int
    split_docs: int


@dataclasses.dataclass(frozen=True)
class ChunkParts:
    """The stored parts of a chunk's (or row group's) documents, without their tokens."""

    part_lengths: np.ndarray    # int64 per part
    part_kinds: np.ndarray      # int64 per part
    part_doc: np.ndarray        # int64 per part: its document, from 0
    num_docs: int
    # Stored images (contracts/media.py): each part's image size, 0 for a text part; None when the
    # file has no such columns.
    part_widths: np.ndarray | None = None
    part_heights: np.ndarray | None = None

    def take(self, parts: np.ndarray | slice, part_doc: np.ndarray, num_docs: int) -> ChunkParts:
        """The layout of parts ``parts`` (a mask, indices or a slice) with their documents
        renumbered as ``part_doc``, ``num_docs`` of them."""
        sizes = [None if a is None else a[parts] for a in (self.part_widths, self.part_heights)]
        return ChunkParts(self.part_lengths[parts], self.part_kinds[parts], part_doc, num_docs, *sizes)

    @functools.cached_property
    def content_lengths(self) -> np.ndarray:
        """Stored tokens of each document (int64)."""
        return np.bincount(self.part_doc, weights=self.part_lengths, minlength=self.num_docs).astype(np.int64)

    @functools.cached_property
    def parts_per_doc(self) -> np.ndarray:
        """Parts of each document (int64)."""
        return np.bincount(self.part_doc, minlength=self.num_docs).astype(np.int64)


# The fields of a ChunkResult's image rows (the catalog's chunk_images columns after dataset, global_index).
IMAGE_ROW_FIELDS = ("doc", "image", "image_id", "width", "height", "format", "mode", "num_bytes")


@dataclasses.dataclass(frozen=True)
class ChunkResult:
    """What the driver commits to the catalog for one chunk."""

    dataset: str
    global_index: int
    num_docs: int
    num_tokens: int
    num_records: int
    num_bytes: int
    checksum: str
    row_group_docs: list[int]
    row_group_tokens: list[int]
    row_group_parts: list[list[int]]    # parts of each kind, per row group
    row_group_part_tokens: list[list[int]]
    rejects: list[Reject]
    source_bytes: int
    seconds: float
    worker: str
    retries: int = 0        # attempts repeated after transient storage errors
    plans: tuple[PlanStats, ...] = ()
    # A chunk of a dataset defined by a filter: per row group of the file, (its first document in
    # the file, the selected documents' indices within it, int32 sorted); None for a built chunk.
    selection: tuple[tuple[int, np.ndarray], ...] | None = None
    # A chunk of a dataset storing its images: its media file's size and sha256, and one row per
    # image occurrence (IMAGE_ROW_FIELDS: doc, image within the doc, image_id, width, ...).
    media_bytes: int | None = None
    media_checksum: str | None = None
    images: tuple[tuple[object, ...], ...] = ()
    # A built chunk's rows of the documents index (:func:`document_rows`); None for a selection.
    documents: pa.Table | None = None


@dataclasses.dataclass(frozen=True)
class GroupCounts:
    """Per row group of a chunk: documents, stored tokens, and parts and tokens of each kind."""

    docs: list[int]
    tokens: list[int]
    parts: list[list[int]]
    part_tokens: list[list[int]]


def _per_group(bounds: np.ndarray, parts: ChunkParts, kinds: int, weights: np.ndarray | None) -> list[list[int]]:
    """Parts (or their tokens, with ``weights``) of each kind in each row group."""
    part_bounds = np.concatenate([[0], np.cumsum(parts.parts_per_doc)])[bounds]
    group = np.repeat(np.arange(len(bounds) - 1), np.diff(part_bounds))
    cell = group * kinds + parts.part_kinds
    counts = np.bincount(cell, weights=weights, minlength=(len(bounds) - 1) * kinds)
    return counts.astype(np.int64).reshape(-1, kinds).tolist()


def group_counts(bounds: np.ndarray, parts: ChunkParts, kinds: int) -> GroupCounts:
    """What the catalog keeps of each row group of a chunk whose documents have ``parts`` and
    whose row group g holds documents ``[bounds[g], bounds[g + 1])`` (a group may be empty)."""
    docs = np.diff(bounds)
    group = np.repeat(np.arange(len(docs)), docs)
    tokens = np.bincount(group, weights=parts.content_lengths.astype(np.float64), minlength=len(docs))
    return GroupCounts(docs.astype(np.int64).tolist(), tokens.astype(np.int64).tolist(),
                       _per_group(bounds, parts, kinds, None),
                       _per_group(bounds, parts, kinds, parts.part_lengths.astype(np.float64)))


def document_rows(global_index: int, table: pa.Table, parts: ChunkParts, kinds: int) -> pa.Table:
    """The documents index rows (``INDEX_COLUMNS``, per-kind tokens, metadata columns) of chunk
    ``global_index`` whose file holds ``table`` (its record and metadata columns are taken as
    stored) with part layout ``parts``: the values the documents view computes from the file, a
    document without parts having NULL token counts as there."""
    docs = parts.num_docs
    empty = parts.parts_per_doc == 0
    per_kind = np.bincount(parts.part_doc * kinds + parts.part_kinds, weights=parts.part_lengths.astype(np.float64),
                           minlength=docs * kinds).astype(np.int64).reshape(docs, kinds)
    mask = empty if empty.any() else None
    columns = {
        "chunk": pa.array(np.full(docs, global_index, np.int64)),
        "doc": pa.array(np.arange(docs, dtype=np.int64)),
        RECORD_COLUMN: table.column(RECORD_COLUMN).combine_chunks().cast(pa.int64()),
        "num_tokens": pa.array(parts.content_lengths, mask=mask),
        "num_parts": pa.array(parts.parts_per_doc),
    }
    for kind in range(kinds):
        columns[f"{KIND_TOKENS_PREFIX}{kind}"] = pa.array(np.ascontiguousarray(per_kind[:, kind]), mask=mask)
    for name in table.column_names:
        if name.startswith(META_PREFIX):
            columns[name] = table.column(name).combine_chunks()
    return pa.table(columns)


def select_parts(parts: ChunkParts, docs: np.ndarray) -> tuple[ChunkParts, np.ndarray]:
    """The part layout of documents ``docs`` (sorted indices) of ``parts``, renumbered from 0,
    and a bool mask of the parts kept."""
    keep = np.zeros(parts.num_docs, bool)
    keep[docs] = True
    mask = keep[parts.part_doc]
    renumber = np.cumsum(keep) - 1
    return parts.take(mask, renumber[parts.part_doc[mask]], len(docs)), mask


def table_parts(table: pa.Table) -> ChunkParts:
    """The part layout of a chunk table (or row groups of one) holding the part columns."""
    lengths = table.column(PART_LENGTHS_COLUMN).combine_chunks()
    kinds = table.column(PART_KINDS_COLUMN).combine_chunks()
    per_doc = np.diff(lengths.offsets.to_numpy())
    docs = len(per_doc)
    sizes = [table.column(name).combine_chunks().values.to_numpy().astype(np.int64)
             if name in table.column_names else None for name in (PART_WIDTHS_COLUMN, PART_HEIGHTS_COLUMN)]
    return ChunkParts(lengths.values.to_numpy().astype(np.int64), kinds.values.to_numpy().astype(np.int64),
                      np.repeat(np.arange(docs, dtype=np.int64), per_doc), docs, *sizes)


def open_chunk(source: pa.NativeFile | io.IOBase | str, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
    """A chunk file opened for reading: every page a read decodes is first checked against the
    CRC-32 its writer stored, so a damaged page raises instead of decoding to wrong tokens (chunks
    written before page checksums have none to check and still read). ``metadata``: the file's
    footer already parsed (it must be this file's), else it is read and parsed here."""
    return pq.ParquetFile(source, metadata=metadata, page_checksum_verification=True)


def size_mismatch(found: int, expected: int) -> str:
    """How a chunk file's size differs from its catalog record's, as errors and reports say it."""
    return f"{found} bytes, the catalog says {expected}"


def sha256_mismatch(found: str, expected: str) -> str:
    """How a chunk file's sha256 differs from its catalog record's, as errors and reports say it."""
    return f"sha256 {found[:16]}…, the catalog says {expected[:16]}…"


def missing_chunk(where: str) -> ChunkIntegrityError:
    """The error for a committed chunk file that is gone (``where`` names its dataset, global index
    and path)."""
    return ChunkIntegrityError(
        f"{where} is missing. The lake is damaged: run `lakeloader build CONFIG` to rebuild the chunk files "
        "that are missing or of the wrong size (`lakeloader verify CONFIG --repair` checks every chunk and "
        "rebuilds the damaged ones).")


def altered_chunk(where: str, problem: str, local_copy: str | None = None) -> ChunkIntegrityError:
    """The error for a chunk file (``where`` names its dataset, global index and path) that does
    not match its catalog record: ``problem`` says how ("has 12 bytes, the catalog says 14");
    ``local_copy``: the disk-cache copy of a remote chunk that was read instead of the lake's file."""
    todo = "run `lakeloader verify CONFIG --repair` to rebuild the damaged chunks of the lake."
    if local_copy is not None:
        todo = (f"it was read from its local copy {local_copy}: if `lakeloader verify CONFIG` finds the lake's "
                f"file intact, delete that copy to download it again; otherwise {todo}")
    return ChunkIntegrityError(f"{where} is corrupt: it {problem}. Never read as data: {todo}")


def unreadable_chunk(where: str, exc: BaseException, local_copy: str | None = None) -> ChunkIntegrityError:
    """The error for a chunk file (``where`` names its dataset, global index and path) that failed
    its page checksums or could not be decoded: never read as data, and what to do about it
    (``local_copy``: the disk-cache copy of a remote chunk that was read instead of the lake's file)."""
    if "CRC checksum verification failed" in str(exc):
        problem = f"a page failed its CRC-32 checksum, the file was altered after it was written ({exc})"
    else:
        problem = f"it cannot be decoded ({type(exc).__name__}: {exc})"
    todo = ("Rebuild the chunk with `lakeloader verify CONFIG --repair` (or restore the file from a copy).")
    if local_copy is not None:
        todo = (f"It was read from its local copy {local_copy}: if `lakeloader verify CONFIG` finds the lake's "
                f"file intact, delete that copy to download it again; otherwise {todo[0].lower()}{todo[1:]}")
    return ChunkIntegrityError(f"{where} is corrupt: {problem}. The damaged data was not used. {todo}")
