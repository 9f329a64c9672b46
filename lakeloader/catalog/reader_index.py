"""The reader index of a published snapshot: what a loader asks the catalog, as Arrow files.

Published next to each snapshot (``catalog-<version>.<table>.arrow``, named by the ``CURRENT``
pointer's ``reader_index``), written from the snapshot copy itself, so its rows are exactly the
snapshot's. A loader memory-maps them and answers its catalog questions (a dataset's plan and
per-chunk counts, the row groups and file records of the chunks a batch reads, packing counts)
with array lookups: no DuckDB database is created, attached or queried on its way to a first
batch (that cost ~40 ms of every open, and a query ~25 ms more at 200,000 chunks).

Files (uncompressed Arrow IPC, one record batch each, rows in (dataset, global_index[, row_group])
order; the metadata of ``chunks`` locates each dataset's rows in every file):

- ``chunks``: one row per planned chunk: counts, committed, the file record, and the media file a
  build's end rewrote for it (``media_file``, null: none);
- ``row_groups``: one row per row group of a committed chunk: its counts;
- ``examples``: one row per chunk counted under a packing plan: its examples.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from lakeloader.catalog.identity import DefinitionRecord
from lakeloader.catalog.sql import query
from lakeloader.contracts.errors import CatalogIntegrityError

INDEX_FORMAT = 1   # in the CURRENT pointer: a reader uses only an index of the format it reads
TABLES = ("chunks", "row_groups", "examples")
_METADATA_KEY = b"lakeloader.reader_index"
# The copy being published, attached under this name on the writer's connection (catalog/queries.sql
# reader_index_* read it).
ATTACHED = "published_snapshot"


def index_file(prefix: str, table: str) -> str:
    """File name of one table of the reader index whose files start with ``prefix``."""
    return f"{prefix}.{table}.arrow"


def _row_ranges(table: pa.Table, keys: list[str]) -> dict[tuple[str, ...], list[int]]:
    """[first, end) rows of each run of equal ``keys`` in ``table`` (sorted by them)."""
    if not table.num_rows:
        return {}
    codes = [table.column(k).combine_chunks().dictionary_encode() for k in keys]
    change = np.zeros(table.num_rows, bool)
    change[0] = True
    for code in codes:
        indices = code.indices.to_numpy()
        change[1:] |= indices[1:] != indices[:-1]
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], table.num_rows)
    names = [code.dictionary.take(code.indices.take(pa.array(starts))).to_pylist() for code in codes]
    return {tuple(values): [int(a), int(b)] for *values, a, b in zip(*names, starts.tolist(), ends.tolist())}


# The queries of catalog/queries.sql a reader index is made of (``reader_index_<part>``), each
# reading the copy attached as ``ATTACHED``; a delta (catalog/delta.py) carries their rows too.
PARTS = ("datasets", "definitions", "packing_plans", *TABLES)
# Per table, the columns its rows are sorted and kept by (dropped from the files: the metadata
# locates each dataset's rows).
_KEY_COLUMNS = {"chunks": ["dataset"], "row_groups": ["dataset"], "examples": ["dataset", "plan_key"]}


def index_rows(con: duckdb.DuckDBPyConnection) -> dict[str, pa.Table]:
    """The rows of each part of the reader index of the catalog attached on ``con`` as ``ATTACHED``."""
    return {part: con.sql(query(f"reader_index_{part}")).to_arrow_table().combine_chunks() for part in PARTS}


def index_tables(rows: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """The reader index's tables made of the rows of its parts (``index_rows``, each table's rows
    in its order), the metadata locating each dataset's rows on ``chunks``."""
    ranges = {table: _row_ranges(rows[table], _KEY_COLUMNS[table]) for table in TABLES}
    tables = {table: rows[table].drop_columns(_KEY_COLUMNS[table]) for table in TABLES}
    tables["chunks"] = tables["chunks"].replace_schema_metadata(_metadata(rows, ranges))
    return tables


def _metadata(rows: dict[str, pa.Table], ranges: dict[str, dict[tuple[str, ...], list[int]]]) -> dict[bytes, bytes]:
    """The ``chunks`` file's schema metadata: each dataset's plan and where its rows lie in each
    table (``ranges``: ``_row_ranges`` of each), from the small parts of ``rows``."""
    plans, packing_plans = rows["datasets"].to_pylist(), rows["packing_plans"].to_pylist()
    datasets = {
        plan["name"]: {
            "fingerprint": plan["fingerprint"], "token_type": plan["token_type"], "fields": plan["fields"],
            "source": plan["source_dataset"], "tokenizer_path": plan["tokenizer_path"],
            "chunks": ranges["chunks"].get((plan["name"],), [0, 0]),
            "row_groups": ranges["row_groups"].get((plan["name"],), [0, 0]),
            "examples": {key: span for (name, key), span in ranges["examples"].items() if name == plan["name"]},
            "packing_plans": [row["plan_key"] for row in packing_plans if row["dataset"] == plan["name"]],
        } for plan in plans}
    definitions: dict[str, list[list[str | None]]] = {}
    for row in rows["definitions"].to_pylist():
        definitions.setdefault(row["dataset"], []).append([row["definition"], row["fingerprint"], row["config"]])
    return {_METADATA_KEY: json.dumps({"datasets": datasets, "definitions": definitions}).encode()}


def write_reader_index(con: duckdb.DuckDBPyConnection, staged: Callable[[str], str]) -> None:
    """Write the reader index of the copy attached on ``con`` as ``published_snapshot``; each
    table to the local path ``staged(table)``, one table in memory at a time (at a million chunks
    the row groups alone are a quarter of a GB)."""
    rows = {part: con.sql(query(f"reader_index_{part}")).to_arrow_table() for part in PARTS if part not in TABLES}
    ranges: dict[str, dict[tuple[str, ...], list[int]]] = {}
    for table in sorted(TABLES, key=lambda t: t == "chunks"):   # chunks last: it says where the others' rows lie
        table_rows = con.sql(query(f"reader_index_{table}")).to_arrow_table().combine_chunks()
        ranges[table] = _row_ranges(table_rows, _KEY_COLUMNS[table])
        table_rows = table_rows.drop_columns(_KEY_COLUMNS[table])
        if table == "chunks":
            table_rows = table_rows.replace_schema_metadata(_metadata(rows, ranges))
        with pa.OSFile(staged(table), "wb") as sink, pa.ipc.new_file(sink, table_rows.schema) as writer:
            writer.write_table(table_rows)
        del table_rows


@dataclasses.dataclass(frozen=True)
class IndexedDataset:
    """One dataset's plan and where its rows lie in the index's files."""

    fingerprint: str
    token_type: str
    fields: list[str]
    source: str | None
    tokenizer_path: str
    chunks: tuple[int, int]
    row_groups: tuple[int, int]
    examples: dict[str, tuple[int, int]]
    packing_plans: frozenset[str]


def _mapped(path: str) -> pa.Table:
    """The Arrow IPC file ``path``, memory-mapped (its pages are read as they are touched)."""
    return pa.ipc.open_file(pa.memory_map(path)).read_all()


def _column(table: pa.Table, name: str) -> pa.Array:
    column = table.column(name)
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


_CHUNK_COLUMNS = ("num_docs", "num_tokens", "committed", "num_parts")   # the query reader_chunks'
_MEDIA_FILE = "media_file"   # a chunk's media file rewritten by a build's end (null: its own); indexes
                             # written before media files were rewritten lack it
# The columns the lookups below read, each with the test its type must pass.
_COLUMNS: dict[str, dict[str, Callable[[pa.DataType], bool]]] = {
    "chunks": {"global_index": pa.types.is_int64, "num_docs": pa.types.is_integer, "num_tokens": pa.types.is_integer,
               "committed": pa.types.is_boolean, "num_parts": pa.types.is_list, "path": pa.types.is_string,
               "num_bytes": pa.types.is_integer, "checksum": pa.types.is_string, "shard_index": pa.types.is_integer},
    "row_groups": {"global_index": pa.types.is_int64, "num_docs": pa.types.is_integer,
                   "num_tokens": pa.types.is_integer, "num_parts": pa.types.is_list},
    "examples": {"global_index": pa.types.is_int64, "num_examples": pa.types.is_integer},
}


def _check_columns(name: str, table: pa.Table) -> None:
    """A ValueError unless ``table`` has the columns the lookups read, of their types."""
    for column, is_kind in _COLUMNS[name].items():
        index = table.schema.get_field_index(column)
        if index < 0 or not is_kind(table.schema.field(index).type):
            raise ValueError(f"{name} has no column {column} of the type lakeloader writes")


def _rows(value: Any, table: pa.Table) -> tuple[int, int]:
    """``value`` as the [first, end) rows of ``table`` it must be (a ValueError if not)."""
    first, end = value
    if not (type(first) is int and type(end) is int and 0 <= first <= end <= table.num_rows):
        raise ValueError(f"rows {value!r} are not a range of the {table.num_rows} rows")
    return first, end


def _strings(value: Any) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        raise ValueError(f"{value!r} is not a list of strings")
    return value


def _indexed_dataset(d: dict[str, Any], tables: dict[str, pa.Table]) -> IndexedDataset:
    """One dataset's entry of the index's metadata, every value checked for its type and range."""
    text = {key: d[key] for key in ("fingerprint", "token_type", "tokenizer_path")}
    if not all(isinstance(value, str) for value in text.values()) or not isinstance(d["source"], (str, type(None))):
        raise ValueError(f"a dataset's names are not strings: {d!r}")
    examples = {key: _rows(rows, tables["examples"]) for key, rows in d["examples"].items()}
    return IndexedDataset(text["fingerprint"], text["token_type"], _strings(d["fields"]), d["source"],
                          text["tokenizer_path"], _rows(d["chunks"], tables["chunks"]),
                          _rows(d["row_groups"], tables["row_groups"]), examples,
                          frozenset(_strings(d["packing_plans"])))


def _definition(row: Any) -> DefinitionRecord:
    """One recorded definition of the index's metadata, its types checked."""
    if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and isinstance(row[1], str)
            and isinstance(row[2], (str, type(None)))):
        raise ValueError(f"a dataset definition is not [definition, fingerprint, config]: {row!r}")
    return DefinitionRecord(row[0], row[1], row[2])


_INDEX_ERRORS = (pa.ArrowException, ValueError, KeyError, TypeError, AttributeError, RecursionError)


def _altered(where: str, exc: Exception) -> CatalogIntegrityError:
    return CatalogIntegrityError(
        f"the reader index {where} is not as lakeloader writes it ({type(exc).__name__}: {exc}): the lake was "
        "altered; read only lakes from people you trust, and if this lake is yours `lakeloader build CONFIG` "
        "publishes a whole catalog again")


class _Layer:
    """The lookups over one set of reader-index tables (a snapshot's files, or the rows its deltas
    add), every array and metadata value checked for what the lookups rely on (valid Arrow data,
    row ranges inside the tables), so even a file altered with a matching checksum gives a clear
    error, never a crash or a read outside its arrays."""

    def __init__(self, tables: dict[str, pa.Table], where: str) -> None:
        try:
            self.tables = tables
            for name, table in self.tables.items():
                _check_columns(name, table)
                table.validate(full=True)
            metadata = json.loads(self.tables["chunks"].schema.metadata[_METADATA_KEY])
            self.datasets = {name: _indexed_dataset(d, self.tables) for name, d in metadata["datasets"].items()}
            # An index written before definitions were recorded has none.
            self._definitions = {name: [_definition(row) for row in rows]
                                 for name, rows in metadata.get("definitions", {}).items()}
        except _INDEX_ERRORS as exc:
            raise _altered(where, exc) from exc

    def plan(self, name: str) -> tuple[str, str, list[str], str | None] | None:
        """Dataset ``name``'s (fingerprint, token_type, part kinds, source dataset), as the
        catalog query reader_dataset returns them; None if the snapshot has no such dataset."""
        found = self.datasets.get(name)
        return None if found is None else (found.fingerprint, found.token_type, found.fields, found.source)

    def definitions(self, name: str) -> list[DefinitionRecord]:
        """The definitions of dataset ``name`` the snapshot recorded (the query dataset_definitions)."""
        return list(self._definitions.get(name, []))

    def tokenizer_path(self, datasets: Sequence[str]) -> str | None:
        """The lake-relative path of the tokenizer copy of the first of ``datasets`` the snapshot
        has (the query tokenizer_path; every dataset of a lake has the lake's tokenizer)."""
        return next((self.datasets[name].tokenizer_path for name in datasets if name in self.datasets), None)

    def chunks(self, name: str, columns: Sequence[str] = _CHUNK_COLUMNS) -> pa.Table:
        """Every planned chunk of dataset ``name`` (the columns of the query reader_chunks with
        the part counts, or ``columns``; no rows for a dataset the snapshot has not)."""
        found = self.datasets.get(name)
        a, b = found.chunks if found else (0, 0)
        return self.tables["chunks"].select(["global_index", *columns]).slice(a, b - a)

    def plan_registered(self, name: str, plan_key: str) -> bool:
        """Whether the snapshot keeps per-chunk counts of packing plan ``plan_key`` for ``name``."""
        found = self.datasets.get(name)
        return found is not None and plan_key in found.packing_plans

    def examples(self, name: str, plan_key: str) -> tuple[np.ndarray, np.ndarray]:
        """Global index and examples of each chunk counted under ``plan_key``, in global order."""
        found = self.datasets.get(name)
        a, b = found.examples.get(plan_key, (0, 0)) if found else (0, 0)
        rows = self.tables["examples"].slice(a, b - a)
        return _column(rows, "global_index").to_numpy(), _column(rows, "num_examples").to_numpy()

    def _chunk_rows(self, name: str, global_indexes: np.ndarray) -> np.ndarray:
        """Rows in ``chunks`` of the committed chunks of ``name`` among ``global_indexes``
        (ascending, distinct)."""
        found = self.datasets.get(name)
        if found is None:
            return np.zeros(0, np.int64)
        a, b = found.chunks
        table = self.tables["chunks"]
        indexes = _column(table, "global_index").slice(a, b - a).to_numpy()
        at = np.searchsorted(indexes, global_indexes)
        inside = at < len(indexes)
        at = at[inside][indexes[at[inside]] == global_indexes[inside]]
        committed = _column(table, "committed").take(pa.array(at + a)).to_numpy(zero_copy_only=False)
        return at[committed] + a

    def row_groups_of(self, name: str, global_indexes: list[int], part_counts: bool) -> dict[str, Any]:
        """The rows the catalog query reader_row_groups_of returns: the row groups of the
        committed chunks among ``global_indexes`` in (chunk, row group) order, each with its
        chunk's file record (``num_parts`` as lists only with ``part_counts``)."""
        wanted = np.unique(np.asarray(global_indexes, np.int64))
        rows = self._chunk_rows(name, wanted)
        chunks = self.tables["chunks"].take(pa.array(rows))
        chunk_index = _column(chunks, "global_index").to_numpy()
        a, b = self.datasets[name].row_groups if name in self.datasets else (0, 0)
        groups = self.tables["row_groups"].slice(a, b - a)
        group_index = _column(groups, "global_index").to_numpy()
        first = np.searchsorted(group_index, chunk_index, side="left")
        end = np.searchsorted(group_index, chunk_index, side="right")
        counts = end - first
        take = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        picked = groups.take(pa.array(take))
        per_chunk = {k: np.repeat(np.asarray(_column(chunks, k).to_numpy(zero_copy_only=False)), counts)
                     for k in ("path", "num_bytes", "checksum", "shard_index")}
        return {"global_index": _column(picked, "global_index").to_numpy(),
                "num_docs": _column(picked, "num_docs").to_numpy(),
                "num_tokens": _column(picked, "num_tokens").to_numpy(),
                "num_parts": _column(picked, "num_parts") if part_counts else None, **per_chunk}

    def record(self, name: str, global_index: int) -> tuple[str, int, str, int] | None:
        """(path, num_bytes, checksum, shard_index) of committed chunk ``global_index`` of
        ``name``, as the query reader_chunk_record; None if it is not committed."""
        rows = self._chunk_rows(name, np.asarray([global_index], np.int64))
        if not len(rows):
            return None
        row = self.tables["chunks"].slice(int(rows[0]), 1).to_pylist()[0]
        return row["path"], row["num_bytes"], row["checksum"], row["shard_index"]



class ReaderIndex:
    """A published version's reader index: its base snapshot's files, memory-mapped, and the rows
    its deltas (catalog/delta.py) add, which replace every row of the chunks they name. Immutable,
    safe to share by threads; it answers as the index of a full snapshot of the same version.

    Its files are those the pointer vouches for (their sha256 checked before they get here), and
    still checked as :class:`_Layer` checks them."""

    def __init__(self, paths: dict[str, str], added: dict[str, pa.Table] | None = None,
                 changed: dict[str, np.ndarray] | None = None, added_where: str = "",
                 previous: ReaderIndex | None = None, base_identity: Any = None) -> None:
        """``added``: the rows of each part (``PARTS``) the deltas carry, newest per chunk;
        ``changed``: per dataset, the global indexes (ascending) of the chunks whose rows they
        replace; ``previous``: a reader's index before a refresh, whose checked base is taken as it
        is if its ``base_identity`` (what names the base's bytes: the lake and their sha256) is
        this one's."""
        where = f"{paths['chunks'].removesuffix('.chunks.arrow')}.*.arrow"
        self.paths, self.base_identity = paths, base_identity
        if previous is not None and base_identity is not None and previous.base_identity == base_identity:
            self._base = previous._base
        else:
            try:
                self._base = _Layer({table: _mapped(paths[table]) for table in TABLES}, where)
            except _INDEX_ERRORS as exc:
                raise _altered(where, exc) from exc
        self._top: _Layer | None = None
        self._changed = changed or {}
        if added is not None:
            try:
                self._top = _Layer(index_tables(added), added_where)
                for table in TABLES:
                    if not self._top.tables[table].schema.equals(self._base.tables[table].schema, check_metadata=False):
                        raise ValueError(f"its {table} rows are not of the columns of its base's")
            except _INDEX_ERRORS as exc:
                raise _altered(added_where, exc) from exc
        self._where = added_where or where
        self._meta = self._top or self._base   # the deltas carry the plans whole

    def plan(self, name: str) -> tuple[str, str, list[str], str | None] | None:
        """Dataset ``name``'s (fingerprint, token_type, part kinds, source dataset), as the
        catalog query reader_dataset returns them; None if the snapshot has no such dataset."""
        return self._meta.plan(name)

    def definitions(self, name: str) -> list[DefinitionRecord]:
        """The definitions of dataset ``name`` the snapshot recorded (the query dataset_definitions)."""
        return self._meta.definitions(name)

    def tokenizer_path(self, datasets: Sequence[str]) -> str | None:
        """The lake-relative path of the tokenizer copy of the first of ``datasets`` the snapshot
        has (the query tokenizer_path; every dataset of a lake has the lake's tokenizer)."""
        return self._meta.tokenizer_path(datasets)

    def plan_registered(self, name: str, plan_key: str) -> bool:
        """Whether the snapshot keeps per-chunk counts of packing plan ``plan_key`` for ``name``."""
        return self._meta.plan_registered(name, plan_key)

    def _split(self, name: str, global_indexes: np.ndarray) -> np.ndarray:
        """Which of ``global_indexes`` are chunks the deltas replace."""
        changed = self._changed.get(name)
        return np.zeros(len(global_indexes), bool) if changed is None else np.isin(global_indexes, changed)

    def chunks(self, name: str, columns: Sequence[str] = _CHUNK_COLUMNS) -> pa.Table:
        """Every planned chunk of dataset ``name`` (the columns of the query reader_chunks with
        the part counts, or ``columns``; no rows for a dataset the snapshot has not)."""
        base = self._base.chunks(name, columns)
        if self._top is None or name not in self._changed:
            return base
        top = self._top.chunks(name, columns)
        planned = _column(base, "global_index").to_numpy()
        replaced = _column(top, "global_index").to_numpy()
        at = np.searchsorted(planned, replaced)
        if (at >= len(planned)).any() or (planned[np.minimum(at, len(planned) - 1)] != replaced).any():
            raise _altered(self._where, ValueError(f"it commits chunks of {name!r} its base does not plan"))
        take = np.arange(len(planned))
        take[at] = len(planned) + np.arange(len(replaced))
        return pa.concat_tables([base, top]).take(pa.array(take))

    def media_files(self) -> dict[str, str] | None:
        """Chunk file -> the media file a build's end rewrote for it (lake paths), of every
        dataset (the query deduped_media_files); None for an index written before media files
        were rewritten (it has no ``media_file`` column)."""
        if _MEDIA_FILE not in self._base.tables["chunks"].column_names:
            return None
        found: dict[str, str] = {}
        for name in self._meta.datasets:
            table = self.chunks(name, ["path", _MEDIA_FILE])
            if not pa.types.is_string(table.schema.field(_MEDIA_FILE).type):
                raise _altered(self._where, ValueError(f"its chunks' {_MEDIA_FILE} are not strings"))
            rewritten = table.filter(table.column(_MEDIA_FILE).is_valid())
            found.update(zip(rewritten.column("path").to_pylist(), rewritten.column(_MEDIA_FILE).to_pylist()))
        return found

    def examples(self, name: str, plan_key: str, prefix: int) -> dict[str, np.ndarray]:
        """Examples of each chunk before ``prefix`` counted under ``plan_key`` (as the query
        reader_chunk_examples: ``global_index`` and ``num_examples``, in global order)."""
        global_index, num_examples = self._base.examples(name, plan_key)
        if self._top is not None and name in self._changed:
            kept = ~self._split(name, global_index)
            added, added_examples = self._top.examples(name, plan_key)
            at = np.searchsorted(global_index[kept], added)
            global_index = np.insert(global_index[kept], at, added)
            num_examples = np.insert(num_examples[kept], at, added_examples)
        end = int(np.searchsorted(global_index, prefix))
        return {"global_index": global_index[:end], "num_examples": num_examples[:end]}

    def row_groups_of(self, name: str, global_indexes: list[int], part_counts: bool) -> dict[str, Any]:
        """The rows the catalog query reader_row_groups_of returns: the row groups of the
        committed chunks among ``global_indexes`` in (chunk, row group) order, each with its
        chunk's file record (``num_parts`` as lists only with ``part_counts``)."""
        if self._top is None or name not in self._changed:
            return self._base.row_groups_of(name, global_indexes, part_counts)
        wanted = np.unique(np.asarray(global_indexes, np.int64))
        replaced = self._split(name, wanted)
        parts = [self._base.row_groups_of(name, wanted[~replaced].tolist(), part_counts),
                 self._top.row_groups_of(name, wanted[replaced].tolist(), part_counts)]
        order = np.argsort(np.concatenate([part["global_index"] for part in parts]), kind="stable")
        merged: dict[str, Any] = {}
        for key in parts[0]:
            if key == "num_parts" and part_counts:
                merged[key] = pa.concat_arrays([parts[0][key], parts[1][key]]).take(pa.array(order))
            elif key == "num_parts":
                merged[key] = None
            else:
                merged[key] = np.concatenate([np.asarray(part[key]) for part in parts])[order]
        return merged

    def record(self, name: str, global_index: int) -> tuple[str, int, str, int] | None:
        """(path, num_bytes, checksum, shard_index) of committed chunk ``global_index`` of
        ``name``, as the query reader_chunk_record; None if it is not committed."""
        replaced = self._top is not None and bool(self._split(name, np.asarray([global_index]))[0])
        return (self._top if replaced else self._base).record(name, global_index)
