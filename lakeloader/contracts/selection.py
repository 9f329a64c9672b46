"""The predicate of a dataset defined by a filter (``from: web, where: "lang = 'en'"``): a pure SQL
expression over the source dataset's metadata fields and ``num_tokens``, checked with DuckDB
against an empty relation of those columns before any work."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from lakeloader.contracts.chunk_file import METADATA_ARROW_TYPES

# The columns a predicate may name besides the metadata fields.
PREDICATE_COLUMNS = {"num_tokens": pa.int64()}
# The predicate is parsed and bound as the WHERE clause of this statement over an empty relation.
# These two statements stay here (not in catalog/queries.sql): the config validates with them and
# sits below the catalog layer; neither touches a catalog.
_CANDIDATE = "candidate"
_WRAPPED = "SELECT 1 FROM candidate WHERE ({where})"
_SERIALIZE = "SELECT json_serialize_sql($statement)"


def _nodes(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _nodes(item)
    elif isinstance(value, list):
        for item in value:
            yield from _nodes(item)


def where_problem(where: str, metadata: Mapping[str, str | None]) -> str | None:
    """What is wrong with ``where`` as a filter (None: nothing): it must be one pure SQL expression
    (no subquery, no statement around it) that DuckDB binds against an empty relation of
    ``metadata`` (field -> string | int | float | bool; an untyped field binds as a string) and
    ``num_tokens``."""
    columns = {**{field: METADATA_ARROW_TYPES.get(kind or "string", pa.string()) for field, kind in metadata.items()},
               **PREDICATE_COLUMNS}
    known = ", ".join(columns)
    if not where.strip():
        return f"the predicate is empty: give a SQL predicate over {known}, e.g. \"num_tokens < 8192\""
    statement = _WRAPPED.format(where=where)
    con = duckdb.connect(config={"enable_external_access": False, "lock_configuration": True})
    try:
        parsed = json.loads(con.execute(_SERIALIZE, {"statement": statement}).fetchall()[0][0])
        if parsed.get("error"):
            return f"not a SQL predicate ({parsed.get('error_message')}); write an expression over {known}"
        statements = parsed["statements"]
        node = statements[0]["node"] if len(statements) == 1 else {}
        pure = (node.get("type") == "SELECT_NODE" and not node.get("modifiers") and not node.get("group_expressions")
                and node.get("having") is None and node.get("qualify") is None and node.get("sample") is None
                and not node.get("cte_map", {}).get("map")
                and node.get("from_table", {}).get("table_name") == _CANDIDATE
                and not any(n.get("class") == "SUBQUERY" for n in _nodes(node.get("where_clause"))))
        if not pure:
            return (f"not one pure expression: a filter is a predicate over {known} (no subquery, no "
                    "statement, no table), e.g. \"lang = 'en' AND num_tokens < 8192\"")
        con.register(_CANDIDATE, pa.table({name: pa.array([], kind) for name, kind in columns.items()}))
        con.execute(statement).fetchall()
    except duckdb.Error as exc:
        return (f"does not bind to the source dataset's columns ({known}): {str(exc).splitlines()[0]}; "
                "fix the predicate or add the field to the source dataset's metadata_fields")
    finally:
        con.close()
    return None


_NORMALIZE = "SELECT json_deserialize_sql(json_serialize_sql($statement))"
# The selected rows of a chunk's candidate relation; the doc column's name cannot be a metadata
# field's (those are identifiers).
_DOC = "lakeloader doc"
_SELECT = 'SELECT "lakeloader doc" FROM candidate WHERE ({where}) ORDER BY 1'


def _sandbox() -> duckdb.DuckDBPyConnection:
    return duckdb.connect(config={"enable_external_access": False, "lock_configuration": True})


def normalized_where(where: str) -> str:
    """``where`` as DuckDB prints it back from its parse tree (spacing, case of keywords and
    redundant parentheses do not change it): what a filtered dataset's fingerprint hashes."""
    con = _sandbox()
    try:
        return str(con.execute(_NORMALIZE, {"statement": _WRAPPED.format(where=where)}).fetchall()[0][0])
    finally:
        con.close()


def select_documents(where: str, columns: pa.Table) -> np.ndarray:
    """Sorted row indices (int32) of ``columns`` (one row per document: ``num_tokens`` and the
    metadata fields by name) for which the predicate ``where`` is true (NULL is not true);
    evaluated by an in-memory DuckDB that can reach no file."""
    con = _sandbox()
    try:
        con.register(_CANDIDATE, columns.append_column(_DOC, pa.array(np.arange(columns.num_rows, dtype=np.int64))))
        found = con.execute(_SELECT.format(where=where)).fetchnumpy()[_DOC]
    finally:
        con.close()
    return np.asarray(found, np.int64).astype(np.int32)
