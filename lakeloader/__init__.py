"""lakeloader: tokenized Parquet lakes built on Dask, catalogued in DuckDB, streamed into JAX.

The heavy parts (Dask, DuckDB, pyarrow) are imported when first used, so ``import lakeloader``
stays fast for command-line help and config validation.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lakeloader.config import Config, load_config
from lakeloader.contracts import VERSION
from lakeloader.contracts.errors import (
    CatalogError,
    CatalogLockedError,
    ChunkIntegrityError,
    ConfigError,
    InputError,
    LakeloaderError,
    SourceError,
)

if TYPE_CHECKING:
    from lakeloader.catalog.lake import Lake
    from lakeloader.feed.loader import Loader
    from lakeloader.ingest.driver import BuildReport

__version__ = VERSION

__all__ = [
    "CatalogError",
    "CatalogLockedError",
    "ChunkIntegrityError",
    "Config",
    "ConfigError",
    "InputError",
    "LakeloaderError",
    "SourceError",
    "build_lake",
    "load_config",
    "open_lake",
    "open_loader",
]


def build_lake(config: Config | str | os.PathLike[str], **options: Any) -> BuildReport:
    """Build or resume the lake of ``config`` (see :func:`lakeloader.ingest.driver.build`).

    (Not named ``build``: that is the name of the build stage's subpackage.)"""
    from lakeloader.ingest.driver import build

    return build(config, **options)


def open_lake(config_or_lake: Config | str | os.PathLike[str], **options: Any) -> Lake:
    """The lake of a config or a lake path/URL, for SQL and status (see :func:`lakeloader.catalog.lake.open_lake`)."""
    from lakeloader.catalog.lake import open_lake as open_lake_at

    return open_lake_at(config_or_lake, **options)


def open_loader(config: Config | str | os.PathLike[str], **options: Any) -> Loader:
    """A batch loader over the lake of ``config`` (see :class:`lakeloader.feed.loader.Loader`)."""
    from lakeloader.feed.loader import Loader

    return Loader(config, **options)
