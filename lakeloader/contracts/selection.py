"""The predicate of a dataset defined by a filter (``from: web, where: "lang = 'en'"``): a pure SQL
expression over the source dataset's metadata fields and ``num_tokens``, checked with DuckDB
against an empty relation of those columns before any work."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from lakeloader.contracts.chunk_file import METADATA_ARROW_TYPES
from lakeloader.contracts.doc_keys import DOC_KEY_COLUMN

# The columns a predicate may name besides the metadata fields (doc_key: contracts/doc_keys.py).
PREDICATE_COLUMNS = {"num_tokens": pa.int64(), DOC_KEY_COLUMN: pa.uint64()}
# The predicate is parsed and bound as the WHERE clause of this statement over an empty relation.
# These statements stay here (not in catalog/queries.sql): the config validates with them and
# sits below the catalog layer; none touches a catalog.
_CANDIDATE = "candidate"
_WRAPPED = "SELECT 1 FROM candidate WHERE ({where})"
_RENDERED = "SELECT 1 FROM candidate WHERE "   # how DuckDB prints _WRAPPED back, before the expression
_SERIALIZE = "SELECT json_serialize_sql($statement)"
_RENDER = "SELECT json_deserialize_sql($tree::JSON)"
# DuckDB's functions whose result is not a function of their arguments (stability VOLATILE or
# CONSISTENT_WITHIN_QUERY in duckdb_functions()): the time, settings, sequences, random numbers,
# error(), sleep_ms(). A selection is the same on every evaluation, so a predicate calls none of
# them. Listed here, not looked up (duckdb_functions() costs ~50 ms); tests compare the list
# with DuckDB's.
IMPURE_FUNCTIONS = frozenset({
    "current_connection_id", "current_database", "current_date", "current_query", "current_query_id",
    "current_schema", "current_schemas", "current_setting", "current_transaction_id", "currval", "error",
    "gen_random_uuid", "get_current_time", "get_current_timestamp", "getvariable", "in_search_path",
    "nextval", "now", "random", "setseed", "setval", "sleep_ms", "stats", "today", "transaction_timestamp",
    "txid_current", "uuid", "uuidv4", "uuidv7", "vector_type", "write_log",
})


class PredicateError(ValueError):
    """A filter's predicate is not one pure SQL expression over its source's columns: the
    message says what is wrong (without saying where: callers name the config key or catalog)."""


def _nodes(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _nodes(item)
    elif isinstance(value, list):
        for item in value:
            yield from _nodes(item)


def _where_clause(tree: dict[str, Any]) -> dict[str, Any] | None:
    """The WHERE expression of a parsed _WRAPPED statement, or None unless the statement is that
    and nothing more: one SELECT of candidate, no subquery, modifier, grouping or CTE."""
    statements = tree["statements"]
    node = statements[0]["node"] if len(statements) == 1 else {}
    pure = (node.get("type") == "SELECT_NODE" and not node.get("modifiers") and not node.get("group_expressions")
            and node.get("having") is None and node.get("qualify") is None and node.get("sample") is None
            and not node.get("cte_map", {}).get("map")
            and node.get("from_table", {}).get("table_name") == _CANDIDATE
            and not any(n.get("class") == "SUBQUERY" for n in _nodes(node.get("where_clause"))))
    return node.get("where_clause") if pure else None


def _unknown_names(where: dict[str, Any], columns: Mapping[str, pa.DataType]) -> tuple[list[str], list[str]]:
    """The column names ``where`` gives that are not ``columns`` (nor a lambda's parameters: DuckDB
    reads a name such as current_date that is no column as a function of the time), and the
    functions it calls that are impure or qualified (a macro of another database)."""
    known = {name.lower() for name in columns}
    known |= {n["column_names"][-1].lower() for lam in _nodes(where) if lam.get("class") == "LAMBDA"
              for n in _nodes(lam.get("lhs")) if n.get("class") == "COLUMN_REF"}
    names = [".".join(n["column_names"]) for n in _nodes(where) if n.get("class") == "COLUMN_REF"
             and (len(n["column_names"]) != 1 or n["column_names"][0].lower() not in known)]
    functions = [".".join(part for part in (n.get("catalog"), n.get("schema"), n["function_name"]) if part)
                 for n in _nodes(where) if n.get("class") == "FUNCTION"
                 and (n["function_name"].lower() in IMPURE_FUNCTIONS or n.get("schema") or n.get("catalog"))]
    return names, functions


def check_predicate(where: str, columns: Mapping[str, pa.DataType]) -> str:
    """``where`` as DuckDB prints its parsed expression back (no comment, its parentheses
    balanced: it cannot end the clause it is put in), checked to be one pure SQL expression over
    ``columns`` (name -> Arrow type): no statement around it, no subquery, table or aggregate, no
    column but those, no impure function (``IMPURE_FUNCTIONS``), and binding to those columns'
    types. A PredicateError says what is wrong. Nothing of it runs: it is parsed and bound only."""
    known = ", ".join(columns)
    if not where.strip():
        raise PredicateError(f"the predicate is empty: give a SQL predicate over {known}, e.g. \"num_tokens < 8192\"")
    impure = PredicateError(f"not one pure expression: a filter is a predicate over {known} (no subquery, no "
                            "statement, no table), e.g. \"lang = 'en' AND num_tokens < 8192\"")
    con = _sandbox()
    try:
        tree = json.loads(con.execute(_SERIALIZE, {"statement": _WRAPPED.format(where=where)}).fetchall()[0][0])
        if tree.get("error"):
            raise PredicateError(f"not a SQL predicate ({tree.get('error_message')}); write an expression over {known}")
        if _where_clause(tree) is None:
            raise impure
        # From here on only DuckDB's own rendering of the tree is used (and checked again).
        rendered = str(con.execute(_RENDER, {"tree": json.dumps(tree)}).fetchall()[0][0])
        if not rendered.startswith(_RENDERED):
            raise impure
        expression = rendered.removeprefix(_RENDERED)
        statement = _WRAPPED.format(where=expression)
        clause = _where_clause(json.loads(con.execute(_SERIALIZE, {"statement": statement}).fetchall()[0][0]))
        if clause is None:
            raise impure
        if any(n.get("class") == "STAR" for n in _nodes(clause)):
            raise PredicateError(f"names columns by a pattern (COLUMNS): a filter names each column it reads, "
                                 f"of {known}")
        names, functions = _unknown_names(clause, columns)
        if functions:
            raise PredicateError(
                f"calls {', '.join(sorted(set(functions)))}: a filter's predicate may call only functions whose "
                "result depends on their arguments alone (no time, setting, random number, sequence, error or "
                f"sleep, no function of another database); write it over {known}")
        if names:
            raise PredicateError(f"does not bind to the source dataset's columns ({known}): column \"{names[0]}\" "
                                 "not found; fix the predicate or add the field to the source dataset's metadata_fields")
        con.register(_CANDIDATE, pa.table({name: pa.array([], kind) for name, kind in columns.items()}))
        con.sql(statement).columns   # bound, never run (a constant in it is not even folded)
    except duckdb.Error as exc:
        raise PredicateError(f"does not bind to the source dataset's columns ({known}): {str(exc).splitlines()[0]}; "
                             "fix the predicate or add the field to the source dataset's metadata_fields") from None
    except RecursionError:   # a tree deeper than Python reads (DuckDB's own limit is 1000 levels)
        raise PredicateError(f"nested too deeply to check; write a flatter predicate over {known}") from None
    finally:
        con.close()
    return expression


def metadata_columns(metadata: Mapping[str, str | None]) -> dict[str, pa.DataType]:
    """The columns a filter of a dataset with ``metadata`` (field -> string | int | float | bool)
    may name, with their Arrow types. A field listed without a type (its type is inferred at
    planning, from the dataset's first file) is NULL-typed: that binds with a value of any type
    (``score >= 0.5``, ``lang = 'en'``), and the planner checks the predicate again against the
    types it inferred."""
    return {**{field: METADATA_ARROW_TYPES.get(kind, pa.string()) if kind else pa.null()
               for field, kind in metadata.items()},
            **PREDICATE_COLUMNS}


def where_problem(where: str, metadata: Mapping[str, str | None]) -> str | None:
    """What is wrong with ``where`` as a filter of a dataset with ``metadata`` (None: nothing):
    :func:`check_predicate` over :func:`metadata_columns`."""
    try:
        check_predicate(where, metadata_columns(metadata))
    except PredicateError as exc:
        return str(exc)
    return None


_NORMALIZE = "SELECT json_deserialize_sql(json_serialize_sql($statement))"
# The selected rows of a chunk's candidate relation; the doc column's name cannot be a metadata
# field's (those are identifiers).
_DOC = "lakeloader doc"
_SELECT = 'SELECT "lakeloader doc" FROM candidate WHERE ({where}) ORDER BY 1'


def _sandbox() -> duckdb.DuckDBPyConnection:
    return duckdb.connect(config={"enable_external_access": False, "lock_configuration": True})


@functools.lru_cache(maxsize=256)   # pure, and asked again by each loader of a config in a process
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
