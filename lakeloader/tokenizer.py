"""Loading the HF tokenizer and encoding documents exactly as whole-document encoding would."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import socket
import sys
import urllib.parse
import urllib.request

import numpy as np
from tokenizers import Tokenizer

from collections.abc import Callable
from typing import Any

from lakeloader.contracts.errors import ConfigError

log = logging.getLogger(__name__)

# Pieces handed to the tokenizer stay below this many characters; longer documents are cut
# at pre-tokenization boundaries and the pieces' ids concatenated.
MAX_PIECE_CHARS = 64 * 1024
_CHECK_MARGIN = 256
HUB_CONNECT_TIMEOUT = 5.0   # seconds to reach the Hugging Face hub before using the local cache only


def load_tokenizer(spec: str) -> Tokenizer:
    """A tokenizer from a ``tokenizer.json`` path, or from a Hugging Face hub name when online."""
    if spec.endswith(".json") or os.path.exists(spec):
        try:
            return Tokenizer.from_file(spec)
        except Exception as exc:
            raise ConfigError(
                f"tokenizer: cannot load {spec!r} as a tokenizers JSON file ({exc}); "
                "point 'tokenizer' at a tokenizer.json or a Hugging Face hub name"
            ) from exc
    return _hub_tokenizer(spec)


def _hub_unreachable(timeout: float = HUB_CONNECT_TIMEOUT) -> str | None:
    """Why the Hugging Face hub (``HF_ENDPOINT``, or the proxy for it) takes no connection within
    ``timeout`` seconds, or None when it does: a quick probe instead of the hub client's
    minutes of retries."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    target = urllib.parse.urlsplit(proxy if "://" in (proxy or "") else f"http://{proxy}") if proxy else endpoint
    host = target.hostname or ""
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"cannot connect to {host}:{port}{' (proxy)' if proxy else ''}: {exc.strerror or exc}"
    return None


def _one_output_for_hub_logs() -> None:
    """huggingface_hub prints its records with a stderr handler of its own and also passes them
    to the root logger; where the application configured the root logger, drop the hub's own
    handler so that each record is printed once, in the application's format."""
    if not logging.getLogger().handlers:
        return
    hub = logging.getLogger("huggingface_hub")
    for handler in list(hub.handlers):
        if type(handler) is logging.StreamHandler and handler.stream is sys.stderr:
            hub.removeHandler(handler)


def _hub_tokenizer(spec: str) -> Tokenizer:
    """``tokenizer.json`` of hub repository ``spec``: downloaded when the hub answers, else from
    the local hub cache; a ConfigError within seconds when neither has it."""
    from huggingface_hub import hf_hub_download

    _one_output_for_hub_logs()
    unreachable = _hub_unreachable()
    try:
        return Tokenizer.from_file(hf_hub_download(spec, "tokenizer.json", local_files_only=unreachable is not None))
    except Exception as exc:
        why = f"the hub is unreachable ({unreachable}) and the local hub cache has no copy" if unreachable else str(exc)
        raise ConfigError(
            f"tokenizer: {spec!r} is not a file and could not be fetched from the Hugging Face hub "
            f"({why}); give a path to tokenizer.json, or a hub name while online"
        ) from exc


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """Content hash of the tokenizer (changes whenever its encoding could change)."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned integer type holding every id of a vocabulary of ``vocab_size``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@functools.lru_cache(maxsize=4)
def cached_tokenizer(path: str) -> Tokenizer:
    """Tokenizer from a local JSON file, loaded once per process (Dask workers reuse it)."""
    return Tokenizer.from_file(path)


HEAD_BYTES = 1 << 18   # the added tokens come before the vocabulary in a tokenizers JSON
_ADDED_TOKENS = re.compile(r'"added_tokens"\s*:\s*')


def added_tokens(head: str) -> dict[str, int] | None:
    """Content -> id of the ``added_tokens`` (special tokens among them) of a tokenizers JSON,
    from its first characters ``head`` alone; None when they are not all in ``head`` (or the key
    is not one of the top-level object's): then only the full tokenizer knows."""
    found = _ADDED_TOKENS.search(head)
    if found is None:
        return None
    try:
        json.loads(head[: found.start()].rstrip().rstrip(",") + "}")   # only top-level keys before it
        tokens, _ = json.JSONDecoder().raw_decode(head, found.end())
        return {str(token["content"]): int(token["id"]) for token in tokens}
    except (ValueError, TypeError, KeyError):
        return None   # not the layout expected: the full tokenizer answers instead


class LazyTokenizer:
    """A lake's tokenizer that answers the ids of its added (special) tokens from the JSON's
    ``added_tokens`` without building the tokenizer (parsing a large vocabulary takes most of a
    second); anything else (another token's id, encoding text, the vocabulary size, ...) loads the
    full :class:`tokenizers.Tokenizer` once and asks it. Ids are the same either way: the
    tokenizer looks added tokens up before its model's vocabulary."""

    def __init__(self, specials: dict[str, int] | None, load: Callable[[], Tokenizer]) -> None:
        self._specials = specials or {}
        self._load = load

    @functools.cached_property
    def full(self) -> Tokenizer:
        """The full tokenizer (loaded on first use)."""
        return self._load()

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` (None if the tokenizer has no such token)."""
        if token in self._specials:
            return self._specials[token]
        return self.full.token_to_id(token)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "full":
            raise AttributeError(name)
        return getattr(self.full, name)


@functools.lru_cache(maxsize=4)
def lazy_tokenizer_file(path: str, size: int, mtime_ns: int) -> LazyTokenizer:
    """:class:`LazyTokenizer` of a local JSON file (once per process and file version)."""
    with open(path, "rb") as handle:
        head = handle.read(HEAD_BYTES).decode("utf-8", errors="replace")
    return LazyTokenizer(added_tokens(head), lambda: cached_tokenizer(path))


def lazy_tokenizer_text(text: str) -> LazyTokenizer:
    """:class:`LazyTokenizer` of a tokenizers JSON document (a remote lake's copy)."""
    return LazyTokenizer(added_tokens(text[:HEAD_BYTES]), lambda: Tokenizer.from_str(text))


class DocumentEncoder:
    """Batched encoding of documents without special tokens.

    Documents longer than :data:`MAX_PIECE_CHARS` are cut at points where the tokenizer's
    pre-tokenizer starts a new pre-token, encoded as pieces in one batch and merged back; the
    result equals encoding the whole document. Tokenizers for which such cuts are not exact
    (a normalizer, a prefix space added to every input) encode long documents whole.
    """

    def __init__(self, tokenizer: Tokenizer, max_piece_chars: int = MAX_PIECE_CHARS) -> None:
        self.tokenizer = tokenizer
        self.max_piece_chars = max_piece_chars
        self.dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
        self.splits_long_documents = self._cuts_are_exact()

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _cuts_are_exact(self) -> bool:
        if self.tokenizer.normalizer is not None or self.tokenizer.pre_tokenizer is None:
            return False
        samples = [("def f(x):\n", "return x\n"), ("Hello world\n", "foo bar"), ("a b", " c\u00e9"), ("x=1;", " y")]
        return all(self._ids(a + b) == self._ids(a) + self._ids(b) for a, b in samples)

    def _is_boundary(self, text: str, cut: int) -> bool:
        # Exact when pre-tokenizing the two sides apart gives the pre-tokens of the whole
        # around the cut (regex look-aheads at a piece's end can merge differently).
        def words(piece: str) -> list[str]:
            return [word for word, _ in self.tokenizer.pre_tokenizer.pre_tokenize_str(piece)]

        left, right = text[max(0, cut - _CHECK_MARGIN) : cut], text[cut : cut + _CHECK_MARGIN]
        return words(left) + words(right) == words(left + right)

    def _cut_points(self, text: str) -> list[int]:
        cuts: list[int] = []
        target = self.max_piece_chars
        last = 0
        while target < len(text) - 1:
            cut = self._find_cut(text, last, target)
            if cut is None:
                break
            cuts.append(cut)
            last = cut
            target = cut + self.max_piece_chars
        return cuts

    def _find_cut(self, text: str, lower: int, target: int) -> int | None:
        # Candidates, searching backwards from target: just after a newline that precedes a
        # non-space, else at a single space between two non-spaces; the pre-tokenizer confirms.
        for sep, offset in (("\n", 1), (" ", 0)):
            position = target
            for _ in range(16):
                found = text.rfind(sep, lower + 1, position)
                if found <= 0:
                    break
                cut = found + offset
                after = text[cut + (1 - offset)] if cut + 1 - offset < len(text) else " "
                before = text[cut - 1]
                if (
                    lower < cut < len(text)
                    and not after.isspace()
                    and (offset == 1 or not before.isspace())
                    and self._is_boundary(text, cut)
                ):
                    return cut
                position = found
        return None

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of ``texts`` concatenated, and each text's token count (no special tokens)."""
        pieces: list[str] = []
        owner: list[int] = []
        for i, text in enumerate(texts):
            cuts = self._cut_points(text) if self.splits_long_documents and len(text) > self.max_piece_chars else []
            if cuts:
                bounds = [0, *cuts, len(text)]
                pieces.extend(text[a:b] for a, b in zip(bounds[:-1], bounds[1:]))
                owner.extend([i] * (len(bounds) - 1))
            else:
                pieces.append(text)
                owner.append(i)
        encodings = self.tokenizer.encode_batch_fast(pieces, add_special_tokens=False)
        piece_lengths = np.fromiter((len(e) for e in encodings), dtype=np.int64, count=len(encodings))
        ids = np.empty(int(piece_lengths.sum()), dtype=self.dtype)
        position = 0
        for encoding, length in zip(encodings, piece_lengths):
            ids[position : position + length] = encoding.ids
            position += length
        lengths = np.bincount(np.asarray(owner, dtype=np.int64), weights=piece_lengths, minlength=len(texts))
        return ids, lengths.astype(np.int64)
