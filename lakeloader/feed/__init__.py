"""Feed: global batches from the indexed example stream, for any process count."""

from lakeloader.feed.loader import Loader, LoaderState

__all__ = ["Loader", "LoaderState"]
