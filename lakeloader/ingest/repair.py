"""Repairing a lake: rebuild the chunks a verify pass found damaged, then verify again."""

from __future__ import annotations

import os

import pandas as pd

from lakeloader.catalog.lake import open_lake
from lakeloader.config import Config, load_config
from lakeloader.contracts.errors import ConfigError
from lakeloader.ingest.driver import build
from lakeloader.read.verify import verify_lake


def repair_lake(config: Config | str | os.PathLike[str], report: pd.DataFrame, *, workers: int | None = None,
                scheduler: str | None = None, progress: bool = True) -> pd.DataFrame:
    """Rebuild every chunk that ``report`` (from :func:`verify_lake`) does not mark ok, then verify
    again and return the new report.

    The rebuild is a ``build`` of ``config`` told to redo those chunks: each is written again byte for
    byte (its checksum must equal the catalog's), and like any build it also rebuilds chunk files
    missing or of the wrong size and finishes chunks not built yet. A damaged documents index file
    (``global_index`` -1) is removed first, so the build forgets it and the documents view reads its
    chunks from their chunk files.
    """
    if not isinstance(config, Config) and not os.fspath(config).endswith((".yaml", ".yml")):
        raise ConfigError(f"repairing needs the config the lake was built from (its sources and tokenizer), "
                          f"not the lake {os.fspath(config)}: run `lakeloader verify CONFIG --repair`")
    config = load_config(config)
    damaged = report[report.status != "ok"]
    lake = open_lake(config)
    for path in damaged.path[damaged.global_index < 0]:
        if lake.fs.exists(lake.path_of(path)):
            lake.fs.rm(lake.path_of(path))
    chunks = damaged[damaged.global_index >= 0]
    build(config, workers=workers, scheduler=scheduler, progress=progress,
          repair=[(row.dataset, int(row.global_index)) for row in chunks.itertuples(index=False)])
    return verify_lake(config, progress=progress)
