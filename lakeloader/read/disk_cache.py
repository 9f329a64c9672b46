"""A bounded local disk cache of remote chunk files (least recently used evicted first).

Only files this cache downloaded live in its folder, so eviction can never delete data the lake
owns. Files are immutable (named by dataset fingerprint), so a cached file never goes stale.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid

from lakeloader.lake import Lake

log = logging.getLogger(__name__)


class DiskCache:
    """Local copies of a remote lake's files, at most ``max_bytes`` in total."""

    def __init__(self, lake: Lake, max_bytes: int) -> None:
        self.lake = lake
        self.max_bytes = max_bytes
        self.folder = os.path.join(lake.cache_dir, "chunks")
        os.makedirs(self.folder, exist_ok=True)
        self._lock = threading.Lock()
        self.downloads = 0
        self.hits = 0

    def _local(self, relative: str) -> str:
        return os.path.join(self.folder, relative.replace("/", "__"))

    def path(self, relative: str, size: int) -> str:
        """Local path of lake file ``relative`` of ``size`` bytes, downloading it if needed."""
        local = self._local(relative)
        if os.path.exists(local) and os.path.getsize(local) == size:
            os.utime(local)  # mark as recently used
            with self._lock:
                self.hits += 1
            return local
        temporary = f"{local}.tmp-{uuid.uuid4().hex}"
        self.lake.fs.get_file(self.lake.path_of(relative), temporary)
        os.replace(temporary, local)
        with self._lock:
            self.downloads += 1
        self._evict(keep=local)
        return local

    def _evict(self, keep: str) -> None:
        with self._lock:
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
