"""Tables for people: DataFrames as text, CSV or JSON (what the command line prints)."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pandas as pd

FORMATS = ("table", "csv", "json")
STATUS_SECTIONS = (("Datasets", "datasets"), ("Shards", "shards"), ("Recent builds", "builds"),
                   ("Stale chunk folders (replaced dataset plans; `lakeloader gc` removes them)",
                    "stale_folders"))


def format_frame(frame: pd.DataFrame, fmt: str) -> str:
    """``frame`` as one CSV table (NULL empty), one JSON document (a list of rows, NULL null) or
    a text table (NULL shown as NULL; an empty frame as its column names); ends with a newline.
    ``fmt`` is one of ``FORMATS``."""
    if fmt == "csv":
        return frame.to_csv(index=False)
    if fmt == "json":
        return frame.to_json(orient="records", date_format="iso", indent=1) + "\n"
    if frame.empty:
        return "(no rows)  columns: " + ", ".join(map(str, frame.columns)) + "\n"
    with pd.option_context("display.max_colwidth", 80, "display.width", 200):
        return frame.astype(object).where(frame.notna(), "NULL").to_string(index=False) + "\n"


def format_status(tables: Mapping[str, pd.DataFrame], fmt: str) -> str:
    """A lake's status tables (``Lake.status()``) as one JSON document (``fmt="json"``: an
    object of tables, each a list of rows) or titled text tables (``"table"``: datasets, shards
    (of a lake of many, those not complete: ``SHOWN_SHARDS``), recent builds, and the stale chunk
    folders when there are any)."""
    if fmt == "json":
        document = {name: json.loads(frame.to_json(orient="records", date_format="iso"))
                    for name, frame in tables.items()}
        return json.dumps(document, indent=1) + "\n"
    return "".join(f"== {title} ==\n{_shards_text(tables[name]) if name == 'shards' else format_frame(tables[name], 'table')}\n"
                   for title, name in STATUS_SECTIONS if name != "stale_folders" or len(tables[name]))


# The text table of status lists every shard of a lake of at most this many, else the shards
# not complete (this many at most) and a count of the others: its time does not grow with the lake.
SHOWN_SHARDS = 20


def _shards_text(shards: pd.DataFrame) -> str:
    """The shards section of the text status (``SHOWN_SHARDS``); csv and json list every shard."""
    total = shards.attrs.get("shards", len(shards))   # (Lake.status(shards_shown=...) counts them there)
    if total <= SHOWN_SHARDS:
        return format_frame(shards, "table")
    unfinished = shards[shards.status != "complete"]
    complete = shards.attrs.get("complete", len(shards) - len(unfinished))
    shown = format_frame(unfinished.head(SHOWN_SHARDS), "table") if len(unfinished) else ""
    more = total - complete - SHOWN_SHARDS
    more_text = f", {more:,} more not complete" if more > 0 else ""
    return (f"{shown}({complete:,} of {total:,} shards complete{more_text}; "
            "`lakeloader status TARGET --format csv --table shards` lists every shard)\n")


def audit_heading(frame: pd.DataFrame) -> str:
    """The line above an audit's text table (:func:`lakeloader.catalog.audit.audit`): the
    mixture, the steps, the examples they hold and where the numbers came from."""
    info = frame.attrs
    first, stop, size = info["first_step"], info["stop_step"], info["batch_size"]
    return (f"mixture {info['mixture_id']}, steps [{first}, {stop}) ({(stop - first) * size:,} examples of "
            f"batch {size}), from the {info['source']}\n")
