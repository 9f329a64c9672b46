"""Access to the SQL files of the top-level ``catalog/`` folder (package ``lakeloader.sql``)."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any

from lakeloader.errors import LakeloaderError

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


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


def example_token_means(con: Any, plans: Mapping[str, str | None], seq_len: int) -> dict[str, float]:
    """Mean non-padding tokens per example of each dataset: ``seq_len`` under ``concat`` (plan
    None), else from the per-chunk counts of its packing plan, which must cover every chunk."""
    means = {}
    for name, plan_key in plans.items():
        if plan_key is None:
            means[name] = float(seq_len)
            continue
        tokens, examples, counted, planned = con.execute(
            query("plan_example_tokens"), {"name": name, "plan_key": plan_key}).fetchone()
        if not examples or counted != planned:
            raise LakeloaderError(
                f"mixture.unit: tokens needs dataset {name!r} complete with example counts for this "
                f"packing ({counted} of {planned} chunks counted): let its build finish, or use unit: examples")
        means[name] = tokens / examples
    return means
