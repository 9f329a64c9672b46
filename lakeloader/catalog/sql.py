"""Access to the SQL files of the top-level ``catalog/`` folder (package ``lakeloader.sql``)."""

from __future__ import annotations

import functools
import re
from importlib import resources

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
