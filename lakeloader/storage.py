"""Small helpers over fsspec filesystems shared by every stage."""

from __future__ import annotations

import os
import uuid
from typing import Any

import fsspec
from fsspec.core import url_to_fs


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local filesystem."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def write_atomically(url: str, data: bytes, storage_options: dict[str, Any]) -> None:
    """Write ``data`` so readers see either no file or the whole file (rename; one PUT remotely)."""
    fs, path = url_to_fs(url, **storage_options)
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
