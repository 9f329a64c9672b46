"""lakeloader: tokenized Parquet lakes built on Dask, catalogued in DuckDB, streamed into JAX."""

from __future__ import annotations

from lakeloader.config import Config, load_config
from lakeloader.errors import (
    CatalogError,
    CatalogLockedError,
    ChunkIntegrityError,
    ConfigError,
    InputError,
    LakeloaderError,
    SourceError,
)

__version__ = "0.1.0"

__all__ = [
    "CatalogError",
    "CatalogLockedError",
    "ChunkIntegrityError",
    "Config",
    "ConfigError",
    "InputError",
    "LakeloaderError",
    "SourceError",
    "build",
    "load_config",
    "open_lake",
]


def build(config, **kwargs):  # noqa: ANN001, ANN201 - thin lazy re-export, see lakeloader.build.driver.build
    """Build (or resume building) the lake of ``config``; see :func:`lakeloader.build.driver.build`."""
    from lakeloader.build.driver import build as _build

    return _build(config, **kwargs)


def open_lake(config_or_lake, **kwargs):  # noqa: ANN001, ANN201 - see lakeloader.lake.open_lake
    """Open a lake for queries; see :func:`lakeloader.lake.open_lake`."""
    from lakeloader.lake import open_lake as _open_lake

    return _open_lake(config_or_lake, **kwargs)
