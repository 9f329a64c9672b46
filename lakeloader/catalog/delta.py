"""Deltas: what one publish adds to the lake's published catalog, when it is not a full snapshot.

A delta (``catalog-<version>.delta.arrow``, catalog/pointer.py ``delta_file``) is one Arrow IPC
file of one row: per table of the catalog it carries (``table.<name>``) a list of its rows, per
part of the reader index (``index.<part>``, catalog/reader_index.py ``PARTS``) a list of that
part's rows, and ``keys``, the (dataset, global_index) of the chunks whose rows it replaces.
Keyed tables (catalog/changes.py) carry every row of those chunks; whole tables every row; static
tables none (their base's rows stand). A version is its base plus every delta after it, each
newer delta's rows of a chunk replacing the older ones' (:func:`merge`). Writing one reads only
the changed chunks' rows: its cost follows what changed, not the lake.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lakeloader.catalog.changes import KEYED_TABLES, STATIC_TABLES
from lakeloader.catalog.reader_index import ATTACHED, PARTS, TABLES, index_rows
from lakeloader.catalog.sql import query
from lakeloader.catalog.store import catalog_tables

_KEYS = "keys"
_KEY_SCHEMA = pa.schema([("dataset", pa.string()), ("global_index", pa.int64())])
# Rows of each reader-index part are kept in this order (catalog/queries.sql reader_index_*).
_INDEX_ORDER = {"chunks": ["dataset", "global_index"], "row_groups": ["dataset", "global_index"],
                "examples": ["dataset", "plan_key", "global_index"]}


def carried_tables() -> tuple[str, ...]:
    """The catalog tables a delta carries rows of (all but the static ones)."""
    return tuple(table for table in catalog_tables() if table not in STATIC_TABLES)


def _column(rows: pa.Table) -> pa.Array:
    """``rows`` as a one-element list column (a large list: any number of rows)."""
    values = rows.to_struct_array().combine_chunks()
    return pa.LargeListArray.from_arrays(pa.array([0, rows.num_rows], pa.int64()), values)


def write_delta(con: duckdb.DuckDBPyConnection, keys: dict[str, set[int]], target: str) -> None:
    """Write to the local path ``target`` the delta of the writer's catalog on ``con`` carrying the
    rows of chunks ``keys`` (per dataset, global indexes) and every whole table."""
    key_rows = pa.table({"dataset": [d for d, indexes in keys.items() for _ in indexes],
                         "global_index": [i for indexes in keys.values() for i in sorted(indexes)]}, _KEY_SCHEMA)
    indexes = key_rows.column("global_index").to_numpy()
    bounds = {"lo": int(indexes.min()) if len(indexes) else 0, "hi": int(indexes.max()) if len(indexes) else -1}
    con.register("delta_keys", key_rows)
    con.execute(query("attach_delta").format(name=ATTACHED))
    try:
        parts: dict[str, pa.Table] = {}
        for table in carried_tables():
            statement = "delta_keyed_rows" if table in KEYED_TABLES else "copy_table"
            con.execute(query(statement).format(name=ATTACHED, table=table), bounds if table in KEYED_TABLES else None)
            parts[f"table.{table}"] = con.sql(query("delta_rows").format(name=ATTACHED, table=table)).to_arrow_table()
        for table in STATIC_TABLES:   # empty, for the reader index's queries
            con.execute(query("delta_no_rows").format(name=ATTACHED, table=table))
        parts.update({f"index.{part}": rows for part, rows in index_rows(con).items()})
    finally:
        con.execute(query("detach_delta").format(name=ATTACHED))
        con.unregister("delta_keys")
    parts[_KEYS] = key_rows
    row = pa.table({name: _column(rows) for name, rows in parts.items()})
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.OSFile(target, "wb") as sink, pa.ipc.new_file(sink, row.schema, options=options) as writer:
        writer.write_table(row)


@dataclasses.dataclass(frozen=True)
class Delta:
    """One delta's rows: per carried table (``tables``), per reader-index part (``index``), and
    the chunks it replaces (``keys``)."""

    keys: pa.Table
    tables: dict[str, pa.Table]
    index: dict[str, pa.Table]


def read_delta(path: str) -> Delta:
    """The delta in the local file ``path``, its Arrow data validated (a ValueError or an
    ArrowException if it is not as :func:`write_delta` writes it)."""
    row = pa.ipc.open_file(pa.memory_map(path)).read_all()
    row.validate(full=True)
    if row.num_rows != 1:
        raise ValueError(f"{row.num_rows} rows, a delta has one")

    def part(name: str) -> pa.Table:
        column = row.column(name).combine_chunks()
        if not pa.types.is_large_list(column.type) or not pa.types.is_struct(column.type.value_type):
            raise ValueError(f"{name} is not a list of rows")
        return pa.Table.from_struct_array(column.values)

    keys = part(_KEYS)
    if not keys.schema.equals(_KEY_SCHEMA):
        raise ValueError("its keys are not (dataset, global_index)")
    names = set(row.column_names)
    expected = {_KEYS, *(f"index.{p}" for p in PARTS), *(f"table.{t}" for t in carried_tables())}
    if names != expected:
        raise ValueError(f"its parts are {sorted(names)}, not {sorted(expected)}")
    return Delta(keys, {t: part(f"table.{t}") for t in carried_tables()}, {p: part(f"index.{p}") for p in PARTS})


@dataclasses.dataclass(frozen=True)
class Merged:
    """What a run of deltas adds to their base: the chunks replaced (``keys``, distinct) and, per
    carried table and reader-index part, the rows of the newest delta naming each chunk (whole
    tables and the index's plans: the newest delta's rows)."""

    keys: pa.Table
    tables: dict[str, pa.Table]
    index: dict[str, pa.Table]

    def changed(self) -> dict[str, np.ndarray]:
        """Per dataset, the global indexes (ascending) of the chunks replaced."""
        datasets = self.keys.column("dataset").to_numpy(zero_copy_only=False)
        indexes = self.keys.column("global_index").to_numpy()
        return {str(d): np.sort(indexes[datasets == d]) for d in np.unique(datasets)} if len(indexes) else {}


def _codes(datasets: pa.ChunkedArray, names: dict[str, int]) -> np.ndarray:
    """The number of each of ``datasets`` in ``names`` (added as they come)."""
    encoded = datasets.combine_chunks().dictionary_encode() if len(datasets) else None
    if encoded is None:
        return np.zeros(0, np.int64)
    numbers = np.array([names.setdefault(str(d), len(names)) for d in encoded.dictionary.to_pylist()], np.int64)
    return numbers[encoded.indices.to_numpy()]


def _keys(table: pa.Table, names: dict[str, int]) -> np.ndarray:
    """Each row's chunk as one int64: its dataset's number in ``names`` and its global index."""
    return (_codes(table.column("dataset"), names) << 40) | table.column("global_index").to_numpy()


def _newest(parts: list[pa.Table], names: dict[str, int], known: np.ndarray, layers: np.ndarray) -> pa.Table:
    """The rows of ``parts`` (one per delta, oldest first) of the newest delta naming their chunk
    (``known``: the chunks named, ascending; ``layers``: the newest delta naming each)."""
    table = pa.concat_tables(parts)
    if not table.num_rows:
        return table
    layer = np.repeat(np.arange(len(parts)), [p.num_rows for p in parts])
    keys = _keys(table, names)
    at = np.minimum(np.searchsorted(known, keys), len(known) - 1)
    newest = np.where(known[at] == keys, layers[at], -1)
    return table.filter(pa.array(newest == layer))


def merge(deltas: Sequence[Delta]) -> Merged:
    """What ``deltas`` (oldest first, one base's consecutive deltas) add to their base."""
    names: dict[str, int] = {}
    every = pa.concat_tables([delta.keys for delta in deltas])
    codes = _keys(every, names)
    layer = np.repeat(np.arange(len(deltas)), [delta.keys.num_rows for delta in deltas])
    order = np.lexsort((layer, codes))
    last = np.append(codes[order][1:] != codes[order][:-1], True)   # the newest delta naming each chunk
    known, layers = codes[order][last], layer[order][last]
    keys = every.take(pa.array(order[last]))
    tables = {}
    for table in deltas[-1].tables:
        if table in KEYED_TABLES:
            tables[table] = _newest([d.tables[table] for d in deltas], names, known, layers)
        else:
            tables[table] = deltas[-1].tables[table]
    index = {}
    for part in PARTS:
        if part in TABLES:
            rows = _newest([d.index[part] for d in deltas], names, known, layers)
            index[part] = rows.take(pc.sort_indices(rows, [(c, "ascending") for c in _INDEX_ORDER[part]]))
        else:
            index[part] = deltas[-1].index[part]
    return Merged(keys, tables, index)


def apply_deltas(path: str, merged: Merged) -> None:
    """Apply what deltas add (``merged``) to the catalog file at the local path ``path`` (a copy
    of their base): the rows of the chunks they replace, and their whole tables, replaced."""
    con = duckdb.connect(path)
    try:
        con.register("delta_keys", merged.keys)
        for table, rows in merged.tables.items():
            con.register("delta_rows", rows)
            # Deleted and inserted in two transactions: DuckDB refuses a key deleted and
            # inserted again in one.
            con.execute(query("apply_delete_keyed" if table in KEYED_TABLES else "apply_delete_whole").format(
                table=table))
            con.execute(query("apply_insert").format(table=table))
            con.unregister("delta_rows")
        con.execute(query("checkpoint"))
    finally:
        con.close()
