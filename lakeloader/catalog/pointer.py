"""The ``CURRENT`` pointer of a lake's published catalog: which snapshot is current, the sha256 of
each of its files, and a checksum of the pointer itself.

The pointer is the first thing a reader takes from a lake, and it names (and vouches for) every
other catalog file the reader opens, so nothing in it is taken on trust: :func:`parse_pointer`
checks its own checksum, the type of every value, and that the names it gives are exactly the
names the version it states has. A reader therefore never joins a name from the lake into a
local path unchecked, and never opens a snapshot or reader index whose bytes differ from those
published (``snapshot.py`` compares them with the sha256 here before use).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from lakeloader.contracts.errors import CatalogIntegrityError

POINTER = "_catalog/CURRENT"
CATALOG_FILE = "catalog"        # the key of the snapshot's DuckDB file in ``sha256``
MAX_POINTER_BYTES = 1 << 16
MAX_DELTAS = 64                 # deltas a pointer may add to its base (a writer compacts sooner)
_CHECKSUM_KEY = "checksum"      # sha256 of the pointer's other keys (``_canonical``)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LAKE_ID = re.compile(r"[0-9a-f]{32}")
_REPUBLISH = ("read only lakes from people you trust; if this lake is yours, `lakeloader build CONFIG` "
              "publishes a whole catalog again")


def snapshot_prefix(version: int) -> str:
    """The name every file of snapshot ``version`` starts with."""
    return f"catalog-{version:06d}"


def snapshot_file(version: int) -> str:
    """The name of snapshot ``version``'s DuckDB file in ``_catalog/``."""
    return f"{snapshot_prefix(version)}.duckdb"


def delta_file(version: int) -> str:
    """The name of the delta file of version ``version`` in ``_catalog/`` (catalog/delta.py)."""
    return f"{snapshot_prefix(version)}.delta.arrow"


def delta_key(version: int) -> str:
    """The key of delta ``version``'s sha256 in a pointer's ``sha256``."""
    return f"delta-{version}"


def base_version(pointer: dict[str, Any]) -> int:
    """The version of the full snapshot a pointer names (its own, unless it adds deltas to an
    older one)."""
    return int(pointer.get("base", pointer["version"]))


def delta_versions(pointer: dict[str, Any]) -> list[int]:
    """The versions of the deltas a pointer adds to its base, oldest first (none for a full snapshot)."""
    return list(range(base_version(pointer) + 1, int(pointer["version"]) + 1))


def _canonical(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def seal_pointer(payload: dict[str, Any]) -> bytes:
    """The bytes of a pointer holding ``payload`` and the checksum of it."""
    sealed = {**payload, _CHECKSUM_KEY: hashlib.sha256(_canonical(payload)).hexdigest()}
    return json.dumps(sealed, sort_keys=True).encode()


def parse_pointer(data: bytes, where: str, tables: tuple[str, ...], index_format: int,
                  sealed: bool = True) -> dict[str, Any]:
    """The pointer read from ``where`` (its URL), checked: a CatalogIntegrityError naming it if it
    fails its checksum or is not as lakeloader writes it. ``tables`` are the reader index's tables
    whose sha256 a pointer to an index of ``index_format`` must give.

    Without ``sealed`` a pointer published before checksums (no ``checksum`` and no ``sha256``) is
    taken too, every other check applied: for a build, which then publishes a sealed one. Readers
    take only sealed pointers."""
    def damaged(why: str) -> CatalogIntegrityError:
        return CatalogIntegrityError(f"the lake's catalog pointer {where} is damaged or was altered ({why}): "
                                     f"no snapshot it names is read; {_REPUBLISH}")

    if len(data) > MAX_POINTER_BYTES:
        raise damaged(f"{len(data)} bytes, a pointer has at most {MAX_POINTER_BYTES}")
    try:
        pointer = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise damaged(f"not JSON: {exc}") from None
    if not isinstance(pointer, dict):
        raise damaged("not a JSON object")
    payload = {key: value for key, value in pointer.items() if key != _CHECKSUM_KEY}
    legacy = not sealed and _CHECKSUM_KEY not in pointer and "sha256" not in pointer
    if _CHECKSUM_KEY not in pointer and not legacy:
        raise damaged("it has no checksum: published by a lakeloader older than checksummed pointers")
    if not legacy and pointer[_CHECKSUM_KEY] != hashlib.sha256(_canonical(payload)).hexdigest():
        raise damaged("its checksum does not match its contents")
    version = pointer.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise damaged(f"version {version!r} is not a positive integer")
    # A version is its base (a full snapshot) plus the deltas of every version after it.
    base = pointer.get("base", version)
    if not isinstance(base, int) or isinstance(base, bool) or not 1 <= base <= version \
            or version - base > MAX_DELTAS:
        raise damaged(f"base {base!r} is not a version from {max(1, version - MAX_DELTAS)} to {version}")
    if pointer.get("deltas", []) != list(range(base + 1, version + 1)):
        raise damaged(f"deltas {pointer.get('deltas')!r} are not the versions after its base {base} up to {version}")
    if pointer.get("file") != snapshot_file(base):
        raise damaged(f"file {pointer.get('file')!r} is not {snapshot_file(base)!r}, the name of version {base}")
    lake_id = pointer.get("lake_id")
    if lake_id is not None and not (isinstance(lake_id, str) and _LAKE_ID.fullmatch(lake_id)):
        raise damaged(f"lake_id {lake_id!r} is not 32 hexadecimal digits")
    index = pointer.get("reader_index")
    files = [CATALOG_FILE]
    if index is not None:
        if not isinstance(index, dict) or index.get("prefix") != snapshot_prefix(base) \
                or not isinstance(index.get("format"), int):
            raise damaged(f"reader_index {index!r} is not {{'prefix': {snapshot_prefix(base)!r}, 'format': N}}")
        if index["format"] == index_format:
            files += tables
    if base < version and (index is None or index["format"] != index_format):
        raise damaged(f"its deltas come without a reader index of format {index_format}")
    files += [delta_key(v) for v in range(base + 1, version + 1)]
    checksums = pointer.get("sha256")
    if legacy and base < version:
        raise damaged("it names deltas but gives no sha256 of them")
    if legacy:
        return pointer
    if not isinstance(checksums, dict):
        raise damaged("it gives no sha256 of the snapshot's files")
    for name in files:
        if not (isinstance(checksums.get(name), str) and _SHA256.fullmatch(checksums[name])):
            raise damaged(f"the sha256 of {name!r} is {checksums.get(name)!r}, not 64 hexadecimal digits")
    return pointer
