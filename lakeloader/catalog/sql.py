"""Access to the SQL files of the top-level ``catalog/`` folder (package ``lakeloader.sql``)."""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any, TypeVar

import duckdb

from lakeloader.contracts.errors import CatalogError, LakeloaderError, QueryLimitError

T = TypeVar("T")
# How long a query that was interrupted (Ctrl-C, its timeout) may take to stop before the caller
# goes on without it; DuckDB checks for an interrupt between vectors, so it takes milliseconds.
INTERRUPT_WAIT_SECONDS = 5.0
_POLL_SECONDS = 0.1

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_EXPLAIN = re.compile(r"^\s*EXPLAIN\s+(?:ANALY[SZ]E\s+)?(?:\([^()]*\)\s*)?", re.IGNORECASE)

# The tables of Lake.status, in order (also `lakeloader status --table`'s choices).
STATUS_TABLES = ("datasets", "shards", "builds", "stale_folders")
# What `lakeloader sql` and Lake.sql accept (also their help text).
ALLOWED_SQL = (
    "one read-only query: SELECT (or WITH, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE) or EXPLAIN of "
    "one, over the catalog's tables, views and table macros. Nothing can be written (no CREATE, "
    "INSERT, UPDATE, DELETE, DROP, COPY, ATTACH, SET, ...) and nothing outside the catalog can be "
    "reached: no other file (read_text, read_parquet, glob, ...), no network, no extension "
    "(INSTALL, LOAD)."
)


def sql_file(name: str) -> str:
    """Text of ``catalog/<name>.sql``."""
    return resources.files("lakeloader.sql").joinpath(f"{name}.sql").read_text(encoding="utf-8")


@functools.cache
def queries() -> dict[str, str]:
    """The named statements of ``catalog/queries.sql``."""
    parts = _NAME.split(sql_file("queries"))
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2])}


def query(name: str) -> str:
    """One named statement of ``catalog/queries.sql``."""
    try:
        return queries()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in catalog/queries.sql") from None


TOKEN_WEIGHTS_NEED = ("mixture.unit: tokens", "or use unit: examples")


def example_token_means(con: Any, plans: Mapping[str, str | None], seq_len: int,
                        needed_by: tuple[str, str] = TOKEN_WEIGHTS_NEED) -> dict[str, float]:
    """Mean non-padding tokens per example of each dataset: ``seq_len`` under ``concat`` (plan
    None), else from the per-chunk counts of its packing plan, which must cover every chunk.
    ``needed_by`` (what needs the means, an alternative) words the error when they do not."""
    means = {}
    for name, plan_key in plans.items():
        if plan_key is None:
            means[name] = float(seq_len)
            continue
        tokens, examples, counted, planned = con.execute(
            query("plan_example_tokens"), {"name": name, "plan_key": plan_key}).fetchone()
        if not examples or counted != planned:
            raise LakeloaderError(
                f"{needed_by[0]} needs dataset {name!r} complete with example counts for this "
                f"packing ({counted} of {planned} chunks counted): let its build finish, {needed_by[1]}")
        means[name] = tokens / examples
    return means


def check_read_only(statement: str) -> None:
    """Raise ``CatalogError`` unless ``statement`` is one read-only query (``ALLOWED_SQL``).

    Only the statement's kind is checked here; the connection (``connect_reader``) is what keeps
    files, the network and extensions out of reach."""
    try:
        parsed = duckdb.extract_statements(statement)
    except duckdb.Error as exc:
        raise CatalogError(f"SQL error: {exc}") from exc
    if len(parsed) != 1:
        raise CatalogError(f"got {len(parsed)} SQL statements; lakeloader sql runs {ALLOWED_SQL}")
    kind = parsed[0].type
    if kind == duckdb.StatementType.EXPLAIN:
        explained = _EXPLAIN.sub("", parsed[0].query, count=1)
        try:
            inner = duckdb.extract_statements(explained) if explained != parsed[0].query else []
        except duckdb.Error:
            inner = []
        if [s.type for s in inner] == [duckdb.StatementType.SELECT]:
            return
    elif kind == duckdb.StatementType.SELECT:
        return
    shown = " ".join(statement.split())
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise CatalogError(f"refused {shown!r} (a {kind.name} statement): lakeloader sql runs {ALLOWED_SQL}")


def run_bounded(con: duckdb.DuckDBPyConnection, call: Callable[[], T], timeout_s: float | None,
                where: str = "the config") -> T:
    """``call()`` (queries on ``con`` and their fetch) run in another thread, interrupted
    (``con.interrupt()``) after ``timeout_s`` seconds (None: never), raising QueryLimitError
    that names ``sql.timeout_s`` of ``where``, or at Ctrl-C, re-raising the KeyboardInterrupt.
    DuckDB does not see SIGINT while it runs a query: this thread waits, so Python does."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def work() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:   # handed to the waiting thread, which raises it
            outcome["error"] = exc
        finally:
            done.set()

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    threading.Thread(target=work, name="lakeloader-sql", daemon=True).start()
    try:
        while not done.wait(_POLL_SECONDS):
            if deadline is not None and time.monotonic() >= deadline:
                con.interrupt()
                done.wait(INTERRUPT_WAIT_SECONDS)
                raise QueryLimitError(
                    f"the query ran longer than sql.timeout_s ({timeout_s:g} s) and was stopped: raise "
                    f"sql.timeout_s in {where} (or null for no limit), or ask for less")
    except KeyboardInterrupt:
        con.interrupt()
        done.wait(INTERRUPT_WAIT_SECONDS)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
