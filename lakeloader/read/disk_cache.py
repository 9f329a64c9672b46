"""A bounded local disk cache of remote chunk files (least recently used evicted first).

Only files this cache downloaded live in its folder, so eviction can never delete data the lake
owns. Files are immutable (named by dataset fingerprint), so a cached file never goes stale.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid

import pyarrow as pa

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.location import checked_name

log = logging.getLogger(__name__)


class DiskCache:
    """Local copies of a remote lake's files, at most ``max_bytes`` in total."""

    def __init__(self, lake: Lake, max_bytes: int) -> None:
        self.lake = lake
        self.max_bytes = max_bytes
        self.folder = os.path.join(lake.cache_dir, "chunks")
        os.makedirs(self.folder, exist_ok=True)
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Event] = {}   # files being downloaded, by lake path
        self.downloads = 0
        self.hits = 0

    def _local(self, relative: str) -> str:
        return os.path.join(self.folder, checked_name(relative, self.lake.url).replace("/", "__"))

    def local_path(self, relative: str) -> str:
        """Where the local copy of lake file ``relative`` is (or would be) kept."""
        return self._local(relative)

    def open(self, relative: str, size: int) -> pa.NativeFile:
        """An open handle of lake file ``relative`` of ``size`` bytes, downloading it if needed:
        threads of this process that ask for a missing file together wait for one download.

        The file is opened under the same lock as eviction, so a concurrent reader's eviction can
        never remove it between "it is cached" and "it is open"; an open handle stays readable
        after its file is evicted.
        """
        local = self._local(relative)
        while True:
            with self._lock:
                handle = self._cached(local, size)
                if handle is not None:
                    return handle
                fetching = self._fetching.get(relative)
                if fetching is None:
                    mine = self._fetching[relative] = threading.Event()
                    break
            # Another thread is downloading this file (a batch reads row groups of one chunk
            # together): wait for it and look again. If it failed, or the file was evicted
            # meanwhile, one of the waiting threads downloads it (a failure then raises there).
            fetching.wait()
        try:
            return self._download(relative, local)
        finally:
            with self._lock:
                del self._fetching[relative]
            mine.set()

    def _cached(self, local: str, size: int) -> pa.NativeFile | None:
        """The cached copy ``local`` opened and marked as just used, if it is whole (holding the lock)."""
        try:
            if os.path.getsize(local) != size:
                return None
        except FileNotFoundError:
            return None
        handle = pa.OSFile(local)
        os.utime(local)
        self.hits += 1
        return handle

    def _download(self, relative: str, local: str) -> pa.NativeFile:
        """Download lake file ``relative`` to ``local`` (through a temporary name) and open it."""
        temporary = f"{local}.tmp-{uuid.uuid4().hex}"
        try:
            self.lake.fs.get_file(self.lake.path_of(relative), temporary)
        except BaseException:
            if os.path.exists(temporary):
                os.remove(temporary)
            raise
        with self._lock:
            os.replace(temporary, local)
            handle = pa.OSFile(local)
            self.downloads += 1
            self._evict(keep=local)
        return handle

    def _evict(self, keep: str) -> None:
        """Remove least recently used files until the folder fits ``max_bytes`` (holding the lock)."""
        entries = []
        for name in os.listdir(self.folder):
            full = os.path.join(self.folder, name)
            if ".tmp-" in name or full == keep:
                continue
            stat = os.stat(full)
            entries.append((stat.st_atime, stat.st_mtime, stat.st_size, full))
        total = sum(e[2] for e in entries) + os.path.getsize(keep)
        for _, _, size, full in sorted(entries):
            if total <= self.max_bytes:
                break
            os.remove(full)
            total -= size
            log.debug("evicted %s from the chunk cache", full)
