"""Which files of a local lake (chunk files, published catalog snapshots and their reader
index) this machine has hashed and found as the catalog or pointer says, so that a later process
(a resumed run, a loader's worker) does not hash them again while they are unchanged.

A record names the file's identity and times as ``fstat`` gives them (device, inode, size,
modification and change times, to the nanosecond) and the sha256 it was found to have. Any write
to the file, a rename over it or a restore from a copy gives it another change time (which no
user call can set back), so a record whose identity still matches vouches for the same bytes;
anything else (a changed file, another checksum in the catalog, a damaged record) means hashing
again. A file whose times lie within :data:`RACY_SECONDS` of the hash is not recorded: on a file
system with coarse timestamps a write just after the hash could keep them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from typing import Any

from lakeloader.storage import remove_quietly, sha256_of

log = logging.getLogger(__name__)

RACY_SECONDS = 2.0
_FOLDER = "hashed"


def whole_sha256(handle: Any) -> str:
    """The sha256 of everything in the seekable binary file ``handle`` (left at its start)."""
    handle.seek(0)
    digest = sha256_of(handle)
    handle.seek(0)
    return digest


def _identity(stat: os.stat_result) -> list[int]:
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


class HashRecords:
    """Records of lake files hashed on this machine, one small JSON file each under
    ``cache_dir/hashed`` (written atomically; read by every process of every reader of the lake)."""

    def __init__(self, cache_dir: str) -> None:
        self.folder = os.path.join(cache_dir, _FOLDER)
        self._warned = False

    def _record_path(self, path: str) -> str:
        return os.path.join(self.folder, hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:32] + ".json")

    def sha256(self, path: str, handle: Any, expected: str) -> str:
        """The sha256 of the file at ``path``, open as ``handle`` (a seekable binary file with a
        ``fileno``; left at its start): ``expected`` unread when a record vouches for it, else
        hashed, and recorded when it is ``expected``."""
        descriptor = handle.fileno()
        if self._vouches(path, descriptor, expected):
            return expected
        hashed_from, hashed_at_ns = os.fstat(descriptor), time.time_ns()
        digest = whole_sha256(handle)
        if digest == expected:
            self._remember(path, descriptor, digest, hashed_from, hashed_at_ns)
        return digest

    def _vouches(self, path: str, descriptor: int, checksum: str) -> bool:
        """Whether a record says the file open as ``descriptor`` (at ``path``), unchanged since it
        was hashed, has sha256 ``checksum``."""
        try:
            with open(self._record_path(path), "rb") as handle:
                record = json.loads(handle.read())
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:   # unreadable or damaged: hashed again, and rewritten
            log.debug("record of hashing %s unreadable (%s): hashing the file again", path, exc)
            return False
        return (isinstance(record, dict) and record.get("sha256") == checksum
                and record.get("identity") == _identity(os.fstat(descriptor)))

    def _remember(self, path: str, descriptor: int, checksum: str, hashed_from: os.stat_result,
                 hashed_at_ns: int) -> None:
        """Record that the file open as ``descriptor`` had sha256 ``checksum`` when hashed from
        ``hashed_at_ns`` (wall clock) on, with ``hashed_from`` its ``fstat`` then: only if it did
        not change while hashed and its times are not within :data:`RACY_SECONDS` of the hash."""
        now = os.fstat(descriptor)
        if _identity(now) != _identity(hashed_from):
            return
        if max(now.st_mtime_ns, now.st_ctime_ns) > hashed_at_ns - int(RACY_SECONDS * 1e9):
            return
        target = self._record_path(path)
        temporary = f"{target}.tmp-{uuid.uuid4().hex}"
        try:
            os.makedirs(self.folder, exist_ok=True)
            with open(temporary, "w") as handle:
                json.dump({"path": os.path.abspath(path), "sha256": checksum, "identity": _identity(now)}, handle)
            os.replace(temporary, target)
        except OSError as exc:
            remove_quietly(temporary)
            if not self._warned:
                self._warned = True
                log.warning("cannot record in %s that chunk files were verified (%s): every new loader "
                            "process hashes them again; make the folder writable or set LAKELOADER_CACHE",
                            self.folder, exc)
