"""A document's stable key (``doc_key``) and the predicates of a held-out split over it.

``doc_key`` is a function of the document's identity alone: the name of its source file (the
last component of its path or URL) and its line (1-based, text and JSON Lines) or row (0-based,
Parquet), as the ``documents`` view shows them. It is the first 8 bytes (big-endian) of the
sha256 of ``name + "\\n" + str(line)`` (UTF-8): the same on any machine, DuckDB version, folder,
object store and rebuild, and unchanged when files are added to or removed from the dataset.
Only the file name counts: two files of one dataset with the same name in different folders give
their documents at the same line the same key (they always fall in the same split).

The build computes it in Python (:func:`doc_keys`) for a filter's predicate; the ``documents``
view computes it in SQL (DuckDB's sha256, catalog/queries.sql ``documents_of_dataset``); tests
check the two agree.
"""

from __future__ import annotations

import hashlib
import re
from fractions import Fraction

import numpy as np

DOC_KEY_COLUMN = "doc_key"
KEY_SPACE = 1 << 64   # doc_key is uniform over [0, 2^64)
_MENTIONS_KEY = re.compile(rf"{DOC_KEY_COLUMN}", re.IGNORECASE)


def key_name(source: str) -> str:
    """What of a source file's path or URL ``doc_key`` hashes: its last component."""
    return source.rstrip("/").rsplit("/", 1)[-1]


def doc_key(source: str, line: int) -> int:
    """The ``doc_key`` of the document at ``line`` (1-based line, or 0-based Parquet row) of the
    file ``source`` (a path or URL: only its name counts)."""
    digest = hashlib.sha256(f"{key_name(source)}\n{line}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big")


def doc_keys(source: str, lines: np.ndarray) -> np.ndarray:
    """The ``doc_key`` (uint64) of the documents at each of ``lines`` of the file ``source``."""
    prefix = hashlib.sha256(f"{key_name(source)}\n".encode("utf-8", "surrogateescape"))
    out = np.empty(len(lines), np.uint64)
    for i, line in enumerate(np.asarray(lines, np.int64).tolist()):
        digest = prefix.copy()
        digest.update(str(line).encode())
        out[i] = int.from_bytes(digest.digest()[:8], "big")
    return out


def mentions_doc_key(where: str) -> bool:
    """Whether a predicate may name ``doc_key`` (then its evaluation needs the documents' keys)."""
    return _MENTIONS_KEY.search(where) is not None


def split_multiplier(seed: int) -> int:
    """The odd number (below 2^63) a split of ``seed`` multiplies doc_key by, modulo 2^64, before
    comparing: 1 for seed 0, else one derived from the seed by sha256."""
    if seed == 0:
        return 1
    digest = hashlib.sha256(f"lakeloader split seed {seed}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 1) | 1


def split_threshold(fraction: float) -> int:
    """The held-out documents' bound: their (mixed) doc_key is below ``fraction`` * 2^64, rounded
    down (exact: the float's own value)."""
    return int(Fraction(fraction) * KEY_SPACE)


def split_predicates(fraction: float, seed: int) -> tuple[str, str]:
    """The predicates (train, validation) of a held-out split of ``fraction`` of the documents,
    chosen by ``seed``: one the negation of the other over a value never NULL, so every document
    satisfies exactly one. Seed 0 holds out the documents whose doc_key is below ``fraction`` *
    2^64; another seed compares doc_key * :func:`split_multiplier` modulo 2^64 instead (a
    bijection of the keys: another set of the same expected size)."""
    multiplier, threshold = split_multiplier(seed), split_threshold(fraction)
    value = DOC_KEY_COLUMN if multiplier == 1 else f"({DOC_KEY_COLUMN}::HUGEINT * {multiplier}) % {KEY_SPACE}"
    return f"{value} >= {threshold}", f"{value} < {threshold}"


def held_out(keys: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Whether each of ``keys`` (uint64) is in the validation part of :func:`split_predicates`
    (the predicate evaluated in Python: for tests and tools)."""
    multiplier, threshold = split_multiplier(seed), split_threshold(fraction)
    return np.array([(int(k) * multiplier) % KEY_SPACE < threshold for k in np.asarray(keys, np.uint64).tolist()],
                    dtype=bool)
