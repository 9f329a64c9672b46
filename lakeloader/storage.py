"""Small helpers over fsspec filesystems shared by every stage."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs

from lakeloader.contracts.errors import LakeWriteError, StorageUnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")


def _transient_types() -> tuple[type[BaseException], ...]:
    """The connection-level errors a retry may cure: the standard library's, and those of the
    object-store clients (botocore, aiohttp) this process has imported. A client never imported
    raised nothing, and importing aiohttp only to name its errors cost ~130 ms of every process's
    start (its SSL context is made on import), workers' included."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    boto = sys.modules.get("botocore.exceptions")
    if boto is not None:
        types += [boto.EndpointConnectionError, boto.ConnectTimeoutError, boto.ReadTimeoutError,
                  boto.ConnectionClosedError]
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        types.append(aiohttp.ClientConnectionError)
    return tuple(types)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a connection-level failure that a
    retry may cure, as opposed to a missing file, a permission problem or bad data."""
    transient = _transient_types()
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (FileNotFoundError, PermissionError, IsADirectoryError)):
            return False
        if isinstance(seen, transient):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def with_retries(call: Callable[[], T], *, what: str, deadline: float,
                 on_retry: Callable[[], None] | None = None) -> T:
    """``call()``, retried with exponential backoff while it fails with transient storage errors,
    for at most ``deadline`` seconds; then :class:`StorageUnavailableError` naming ``what``."""
    started = time.monotonic()
    delay = 0.25
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            waited = time.monotonic() - started
            if waited + delay > deadline:
                raise StorageUnavailableError(
                    f"{what}: storage unreachable for {waited:.0f}s ({type(exc).__name__}: {exc}). "
                    "Check the endpoint and credentials, then re-run (builds resume, readers restore "
                    "from their saved step), or raise io_retry_deadline in the config."
                ) from exc
            log.warning("%s: %s; retrying in %.1fs", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 8.0)
            if on_retry is not None:
                on_retry()


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local filesystem."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def sha256_of(handle: Any, block_size: int = 8 << 20) -> str:
    """Hex sha256 of everything an open binary file yields from its current position on."""
    digest = hashlib.sha256()
    while block := handle.read(block_size):
        digest.update(block)
    return digest.hexdigest()


def write_atomically(url: str, data: bytes, storage_options: dict[str, Any]) -> None:
    """Write ``data`` so readers see either no file or the whole file (rename; one PUT remotely)."""
    fs, path = url_to_fs(url, **storage_options)
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        remove_quietly(temporary)  # a full disk must not also keep the partial file
        raise


def remove_quietly(path: str) -> None:
    """Delete the local file ``path`` if it exists (cleanup on an error path: never raises)."""
    try:
        os.remove(path)
    except OSError:
        pass


def write_failure(what: str, path: str, exc: BaseException) -> LakeWriteError:
    """A :class:`LakeWriteError` for an OS error writing ``path``: says what failed and what to do."""
    reason = getattr(exc, "strerror", None) or str(exc)
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        advice = "free space there (or point `lake:` at a larger disk)"
    elif code == errno.EROFS:
        advice = "the file system is read-only: remount it read-write or point `lake:` at a writable folder"
    elif code in (errno.EACCES, errno.EPERM):
        advice = "give this user write permission there or point `lake:` at a writable folder"
    else:
        advice = "fix the path (or point `lake:` at a writable folder)"
    return LakeWriteError(f"{what}: cannot write {path}: {reason}. {advice[0].upper()}{advice[1:]}, then re-run "
                          "`lakeloader build CONFIG` (it resumes from the committed chunks)")
