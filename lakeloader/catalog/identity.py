"""Which definition of a dataset name the lake holds, and whether it is a config's own.

A dataset plan is identified by its fingerprint (what defines its chunks); a dataset name is a
config's label for one. A lake holds one plan per name at a time (``dataset_plans``, the last
build's), and records in ``dataset_definitions`` which plan each config definition of the name
(:func:`~lakeloader.plan.planner.definition_fingerprint`) was last built as, and by which config
file. A reader of a config (a loader, ``status`` and ``stats`` of the config) reads the lake's
plan of a name only if it is its own: for a dataset built from sources, the plan its own
definition was last built as; for a dataset defined by a filter, the selection of its own
predicate from its source's plan (itself checked so). Otherwise one error says which config's
definition the lake holds and what to do; never is another definition's data served.

A lake whose catalog recorded no definition of a name (built before definitions were recorded)
is read as before: its plan of the name is taken as the config's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import duckdb

from lakeloader.catalog.sql import query
from lakeloader.config import Config
from lakeloader.contracts.errors import CatalogError
from lakeloader.plan.planner import definition_fingerprint, filter_fingerprint


@dataclasses.dataclass(frozen=True)
class DefinitionRecord:
    """One recorded definition of a dataset name: the plan it was last built as, and by whom."""

    definition: str
    fingerprint: str
    config: str | None   # the config file that built it (None: a Config object)


PlanOf = Callable[[str], tuple[str, str | None] | None]   # name -> (fingerprint, source dataset) | None
DefinitionsOf = Callable[[str], list[DefinitionRecord]]


def definition_records(con: Any, name: str) -> list[DefinitionRecord]:
    """The definitions of dataset ``name`` the catalog on ``con`` recorded, the newest first (none
    for a catalog from before they were recorded)."""
    try:
        rows = con.execute(query("dataset_definitions"), {"name": name}).fetchall()
    except duckdb.CatalogException:   # a catalog without the table: nothing recorded
        return []
    return [DefinitionRecord(str(d), str(f), c) for d, f, c in rows]


def catalog_plan(con: Any, name: str) -> tuple[str, str | None] | None:
    """Dataset ``name``'s plan fingerprint and source dataset in the catalog on ``con`` (None: none)."""
    row = con.execute(query("reader_dataset"), {"name": name}).fetchone()
    return None if row is None else (str(row[0]), row[3])


def _builders(records: list[DefinitionRecord], fingerprint: str) -> str:
    """Who built plan ``fingerprint``, in words, from the recorded definitions."""
    configs = sorted({r.config or "a Config object (no file)" for r in records if r.fingerprint == fingerprint})
    return " or ".join(configs) if configs else "a config whose definition was not recorded (an older lakeloader)"


def replaced_definitions(con: Any, name: str, fingerprint: str, definition: str | None,
                         config_file: str | None) -> str:
    """The other configs, in words, whose other definition of ``name`` the lake's plan
    ``fingerprint`` is (what a build of ``definition`` by ``config_file`` replaces); empty when none
    was recorded (or only by ``config_file`` itself: its own definition changed)."""
    records = [r for r in definition_records(con, name)
               if r.definition != definition and (r.config is None or r.config != config_file)]
    return _builders(records, fingerprint) if any(r.fingerprint == fingerprint for r in records) else ""


def own_plan_problem(config: Config, name: str, url: str, plan_of: PlanOf,
                     definitions_of: DefinitionsOf) -> str | None:
    """Why the lake (``url``) does not hold ``config``'s own definition of dataset ``name`` (None:
    it does, the lake has no plan of the name, or it recorded no definition of it)."""
    config_file = config.source_file or "this config"
    dataset = config.datasets[name]
    plan = plan_of(name)
    if plan is None:
        return None
    if dataset.from_ is not None:
        source = plan_of(dataset.from_)
        if source is not None and filter_fingerprint(source[0], dataset.where or "") == plan[0]:
            return None
        return (f"dataset {name!r} of lake {url} is not the selection {config_file} defines (from: {dataset.from_}, "
                f"where: {dataset.where}): it was built by a config with another predicate or source. Build this "
                f"config's (lakeloader build {config_file}; it tokenizes nothing), or give the dataset a name of its own")
    records = definitions_of(name)
    if not records:
        return None
    mine = definition_fingerprint(name, config)
    own = next((r for r in records if r.definition == mine), None)
    if own is not None and own.fingerprint == plan[0]:
        return None
    was = (f"{config_file}'s was last built as plan {own.fingerprint[:12]}" if own is not None
           else f"{config_file}'s definition was never built into it")
    return (f"dataset {name!r} of lake {url} holds another definition than {config_file}'s (its plan "
            f"{plan[0][:12]} was built from {_builders(records, plan[0])}; {was}): build this config "
            f"(lakeloader build {config_file}) or give the dataset a name of its own")


def check_own_plans(config: Config, names: Sequence[str], url: str, plan_of: PlanOf,
                    definitions_of: DefinitionsOf) -> None:
    """A CatalogError unless the lake (``url``) holds ``config``'s own definition of each of
    ``names`` and of the sources of those defined by a filter (checked first); ``plan_of`` and
    ``definitions_of`` answer from the lake's catalog."""
    sources = [config.datasets[n].from_ for n in names if config.datasets[n].from_ is not None]
    ordered = list(dict.fromkeys([*sources, *(n for n in names if config.datasets[n].from_ is None),
                                  *(n for n in names if config.datasets[n].from_ is not None)]))
    for name in ordered:
        problem = own_plan_problem(config, name, url, plan_of, definitions_of)
        if problem is not None:
            raise CatalogError(problem)


def check_own_plans_in(con: Any, config: Config, names: Sequence[str], url: str) -> None:
    """:func:`check_own_plans` against the catalog on ``con`` (a catalog connection or cursor)."""
    check_own_plans(config, names, url, lambda name: catalog_plan(con, name),
                    lambda name: definition_records(con, name))
