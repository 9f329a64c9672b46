"""CatalogWriter.transaction(): one helper for every catalog write that must be all or nothing."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from lakeloader.catalog.store import CatalogWriter

PACKAGE = Path(__file__).resolve().parents[1] / "lakeloader"


def _builds(writer: CatalogWriter) -> int:
    return int(writer.con.execute("SELECT count(*) FROM builds").fetchone()[0])


def test_transaction_commits_the_block(tmp_path: Path) -> None:
    path = str(tmp_path / "catalog.duckdb")
    with CatalogWriter(path) as writer:
        with writer.transaction():
            writer.start_build(workers=1, scheduler="local", dashboard="", version="test")
            writer.start_build(workers=1, scheduler="local", dashboard="", version="test")
    con = duckdb.connect(path, read_only=True)
    assert con.execute("SELECT count(*) FROM builds").fetchone()[0] == 2
    con.close()


def test_transaction_rolls_back_everything_and_reraises(tmp_path: Path) -> None:
    with CatalogWriter(str(tmp_path / "catalog.duckdb")) as writer:
        writer.start_build(workers=1, scheduler="local", dashboard="", version="test")
        with pytest.raises(KeyError, match="boom"):
            with writer.transaction():
                writer.start_build(workers=1, scheduler="local", dashboard="", version="test")
                raise KeyError("boom")
        assert _builds(writer) == 1  # the write inside the failed block is gone, the one before kept
        with writer.transaction():  # the connection is usable again: no transaction left open
            writer.start_build(workers=1, scheduler="local", dashboard="", version="test")
        assert _builds(writer) == 2


def test_transaction_frames_are_views_only_inside_it(tmp_path: Path) -> None:
    frame = pd.DataFrame({"x": [1, 2, 3]})
    with CatalogWriter(str(tmp_path / "catalog.duckdb")) as writer:
        with writer.transaction(new_rows=frame):
            assert writer.con.execute("SELECT sum(x) FROM new_rows").fetchone()[0] == 6
        with pytest.raises(duckdb.CatalogException):
            writer.con.execute("SELECT * FROM new_rows")
        with pytest.raises(RuntimeError):
            with writer.transaction(new_rows=frame):
                raise RuntimeError("fails inside")
        with pytest.raises(duckdb.CatalogException):  # unregistered after a rollback too
            writer.con.execute("SELECT * FROM new_rows")


def test_no_module_spells_out_begin_commit_or_rollback() -> None:
    spelled = re.compile(r"""execute\(\s*["'](BEGIN|COMMIT|ROLLBACK)""", re.IGNORECASE)
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{number}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if spelled.search(line)]
    assert offenders == [], f"use CatalogWriter.transaction() instead: {offenders}"
