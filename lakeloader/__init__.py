"""lakeloader: tokenized Parquet lakes built on Dask, catalogued in DuckDB, streamed into JAX.

The public door: everything a user needs is importable from here (``from lakeloader import
Loader, JaxFeed, build_lake, open_lake, load_config``). The heavy parts (Dask, DuckDB, pyarrow,
JAX) are imported when a name that needs them is first used, so ``import lakeloader`` stays fast
for command-line help and config validation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
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
    from lakeloader.catalog.store import LiveCatalog
    from lakeloader.feed.jax import JaxFeed
    from lakeloader.feed.loader import Loader
    from lakeloader.feed.run_state import LoaderState
    from lakeloader.ingest.driver import BuildReport
    from lakeloader.specs import dataset_names

# Names served on first use (module, attribute): importing them here would load JAX or DuckDB.
_ON_FIRST_USE = {
    "BuildReport": ("lakeloader.ingest.driver", "BuildReport"),
    "JaxFeed": ("lakeloader.feed.jax", "JaxFeed"),
    "Lake": ("lakeloader.catalog.lake", "Lake"),
    "LiveCatalog": ("lakeloader.catalog.store", "LiveCatalog"),
    "Loader": ("lakeloader.feed.loader", "Loader"),
    "LoaderState": ("lakeloader.feed.run_state", "LoaderState"),
    "dataset_names": ("lakeloader.specs", "dataset_names"),
}

__version__ = VERSION

__all__ = [
    "BuildReport",
    "CatalogError",
    "CatalogLockedError",
    "ChunkIntegrityError",
    "Config",
    "ConfigError",
    "InputError",
    "JaxFeed",
    "Lake",
    "LakeloaderError",
    "LiveCatalog",
    "Loader",
    "LoaderState",
    "SourceError",
    "build_lake",
    "dataset_names",
    "load_config",
    "open_lake",
    "open_loader",
]


def build_lake(config: Config | str | os.PathLike[str], *, workers: int | None = None,
               scheduler: str | None = None, progress: bool = True, recover_catalog: bool = False,
               dashboard_address: str | None = None, live: LiveCatalog | None = None) -> BuildReport:
    """Build or resume the lake of ``config`` (see :func:`lakeloader.ingest.driver.build`; ``live``:
    a handle through which loaders of this process read the build's live catalog)."""
    from lakeloader.ingest.driver import build

    return build(config, workers=workers, scheduler=scheduler, progress=progress, recover_catalog=recover_catalog,
                 dashboard_address=dashboard_address, live=live)


def open_lake(config_or_lake: Config | str | os.PathLike[str],
              storage_options: dict[str, Any] | None = None) -> Lake:
    """The lake of a config or a lake path/URL (``storage_options`` for a URL's object store), for
    SQL and status (see :func:`lakeloader.catalog.lake.open_lake`)."""
    from lakeloader.catalog.lake import open_lake as open_lake_at

    return open_lake_at(config_or_lake, storage_options)


def open_loader(config: Config | str | os.PathLike[str], *, process_index: int = 0, process_count: int = 1,
                mode: str = "train", rows: Sequence[int] | None = None, catalog: LiveCatalog | None = None) -> Loader:
    """A batch loader over the lake of ``config`` for process ``process_index`` of
    ``process_count`` (``mode``: train or eval; ``rows``: the rows of each batch this process
    owns, for other shardings; ``catalog``: a build's live-catalog handle; see
    :class:`lakeloader.feed.loader.Loader`)."""
    from lakeloader.feed.loader import Loader

    return Loader(config, process_index=process_index, process_count=process_count, mode=mode, rows=rows,
                  catalog=catalog)


def __getattr__(name: str) -> Any:
    """The names of ``_ON_FIRST_USE``, imported when first asked for."""
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module 'lakeloader' has no attribute {name!r}")
    import importlib

    module, attribute = _ON_FIRST_USE[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ON_FIRST_USE))
