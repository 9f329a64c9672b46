"""Catalog: the DuckDB database of a lake, its single writer and its published snapshots."""

from lakeloader.catalog.snapshot import open_snapshot, publish_snapshot
from lakeloader.catalog.store import CatalogWriter, connect_reader

__all__ = ["CatalogWriter", "connect_reader", "open_snapshot", "publish_snapshot"]
