"""Where a lake is (local or any fsspec URL): paths inside it and its local cache folder."""

from __future__ import annotations

import hashlib
import os
import posixpath
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs

from lakeloader.config import DEFAULT_IO_RETRY_DEADLINE, WRITER_CATALOG
from lakeloader.contracts.errors import CatalogIntegrityError
from lakeloader.storage import is_local, with_retries

_FORBIDDEN_CHARACTERS = ("\\", "\x00", ":")


def checked_name(relative: str, url: str = "the lake") -> str:
    """``relative`` if it is a name inside the lake (slash-separated parts, none empty, ``.`` or
    ``..``, no backslash, colon or NUL): every path a reader takes from a lake's files goes
    through here before it is joined to anything, so a damaged or hostile catalog can name no
    file outside the lake (nor, for a remote lake, outside its local cache)."""
    parts = relative.split("/") if isinstance(relative, str) else [""]
    if any(part in ("", ".", "..") for part in parts) or any(c in relative for c in _FORBIDDEN_CHARACTERS):
        raise CatalogIntegrityError(
            f"the catalog of lake {url} names the file {relative!r}, which is not a name inside the lake: "
            "the catalog was altered or damaged; read only lakes from people you trust, and rebuild this "
            "one (lakeloader build CONFIG into a new lake) or restore it from a trusted copy")
    return relative


def default_cache_dir() -> str:
    """Local folder for catalogs and chunk caches of remote lakes (``LAKELOADER_CACHE``)."""
    return os.environ.get("LAKELOADER_CACHE", os.path.join(Path.home(), ".cache", "lakeloader"))


class LakeLocation:
    """Where a lake is: its URL, filesystem, paths inside it and its local cache folder."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 io_retry_deadline: float = DEFAULT_IO_RETRY_DEADLINE) -> None:
        self.storage_options = dict(storage_options or {})
        self.io_retry_deadline = io_retry_deadline  # seconds of retrying unreachable storage
        self.fs, self.root = url_to_fs(url, **self.storage_options)
        self.is_local = is_local(self.fs)
        self.url = self.root if self.is_local else self.fs.unstrip_protocol(self.root)
        key = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.cache_dir = os.path.join(default_cache_dir(), "lakes", key)

    def describe(self) -> str:
        """The lake's URL, with the object-store endpoint it is reached through if one is set."""
        options = self.storage_options
        endpoint = options.get("endpoint_url") or options.get("client_kwargs", {}).get("endpoint_url")
        return f"{self.url} (endpoint {endpoint})" if endpoint else self.url

    def path_of(self, relative: str) -> str:
        """Filesystem path (for ``self.fs``) of a lake-relative path (``checked_name``)."""
        return f"{self.root.rstrip('/')}/{checked_name(relative, self.url)}"

    def url_of(self, relative: str) -> str:
        """Full URL (or absolute local path) of a lake-relative path (``checked_name``)."""
        return f"{self.url.rstrip('/')}/{checked_name(relative, self.url)}"

    def file_sizes(self, folder: str, what: str) -> dict[str, int]:
        """Lake-relative path -> size of every file in the lake folder ``folder`` (one listing, never
        from fsspec's cache; none if it does not exist), retried while the storage is unreachable;
        ``what`` names the folder in that error."""
        full = self.path_of(folder)

        def listing() -> list[dict[str, Any]]:
            self.fs.invalidate_cache(full)
            try:
                return self.fs.ls(full, detail=True)
            except FileNotFoundError:
                return []

        entries = with_retries(listing, what=f"listing {what} {self.url_of(folder)}", deadline=self.io_retry_deadline)
        return {f"{folder}/{posixpath.basename(entry['name'].rstrip('/'))}": int(entry["size"])
                for entry in entries if entry.get("type") == "file"}

    @property
    def writer_catalog_path(self) -> str:
        """The build driver's read-write catalog: in the lake if local, else in the local cache."""
        if self.is_local:
            return self.path_of(WRITER_CATALOG)
        return os.path.join(self.cache_dir, WRITER_CATALOG)
