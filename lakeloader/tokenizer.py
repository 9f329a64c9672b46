"""Loading the HF tokenizer and encoding documents exactly as whole-document encoding would.

Two encoders give the ids: ``hf`` (Hugging Face ``tokenizers``, the reference) and
``fastokens`` (a faster Rust encoder reading the same ``tokenizer.json``). :func:`resolve_backend`
picks one at planning from the config's ``tokenizer_backend`` after a self-check against the
reference; workers check one document of every chunk against the reference again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import random
import re
import socket
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from lakeloader.contracts.errors import ConfigError, LakeloaderError

log = logging.getLogger(__name__)

# Pieces handed to the tokenizer stay below this many characters; longer documents are cut
# at pre-tokenization boundaries and the pieces' ids concatenated.
MAX_PIECE_CHARS = 64 * 1024
_CHECK_MARGIN = 256
HUB_CONNECT_TIMEOUT = 5.0   # seconds to reach the Hugging Face hub before using the local cache only

BACKENDS = ("auto", "hf", "fastokens")   # values of the config key tokenizer_backend
# Workers encode one document of each chunk of at most this many characters with the reference too.
VERIFY_SAMPLE_CHARS = 16 * 1024


class EncoderMismatchError(LakeloaderError):
    """The fast encoder gave other ids than the reference, or a worker's encoder is not the one
    the dataset was planned with. Raised inside Dask tasks: the message is its only argument."""


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


def tokenizer_fingerprint(tokenizer: Tokenizer, text: str | None = None) -> str:
    """Content hash of the tokenizer (changes whenever its encoding could change); ``text``: its
    JSON (``tokenizer.to_str()``) when the caller has it already (serializing a large vocabulary
    takes tens of milliseconds)."""
    return hashlib.sha256((tokenizer.to_str() if text is None else text).encode()).hexdigest()


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


def encoder_name(backend: str) -> str:
    """Name and version of the package that encodes for ``backend`` (``hf`` or ``fastokens``),
    as recorded in dataset plans and builds: ``tokenizers 0.23.3``, ``fastokens 0.3.5``."""
    if backend == "hf":
        return f"tokenizers {tokenizers.__version__}"
    if backend == "fastokens":
        return f"fastokens {importlib.metadata.version('fastokens')}"
    raise ValueError(f"unknown tokenizer backend {backend!r}; expected one of {BACKENDS[1:]}")


def backend_of(name: str) -> str:
    """The backend (``hf`` or ``fastokens``) of an :func:`encoder_name`; ``hf`` for an empty name
    (plans made before the encoder was recorded)."""
    return "fastokens" if name.startswith("fastokens ") else "hf"


def _fast_tokenizer(tokenizer: Tokenizer, text: str | None = None) -> object:
    """``tokenizer`` (whose JSON is ``text`` when given) loaded by fastokens (ImportError or
    ValueError when it cannot be)."""
    import fastokens

    return fastokens.Tokenizer.from_json_str(tokenizer.to_str() if text is None else text)


def _self_check_texts(tokenizer: Tokenizer) -> list[tuple[str, str]]:
    """Named texts on which a fast encoder must agree with the reference: whitespace runs,
    unicode (combining marks, emoji, CJK, right-to-left, text that normalization would change),
    added and special tokens inside text, vocabulary pieces, empty strings, and a document over
    the long-document cut."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    step = max(1, vocab_size // 3000)
    pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in range(0, vocab_size, step)]
    added = [token.content for token in tokenizer.get_added_tokens_decoder().values()][:500]
    rng = random.Random(16)
    pool = ("abcxyzABC0189 _-.,;:!?'\"()[]{}<>/\\|@#$%^&*=+~`\t\n\r \u00a0\u3000\u200b\u200d\ufeff"
            "\u0301\u0308\u0327\u05b0\u0651éñüßøÅ\u212bﬁ²½Ωπ漢字かなカナ한국어שלוםمرحبا"
            "नमस्ते😀👍🏽👨‍👩‍👧🇫🇷\x00\x01\x7f")
    code = "def f(x):\n    return x  \n\n\n    # comment\r\n\tif x:\n\t\tpass\n"
    unit = code + "Ünïcödé text, 漢字 and 👍🏽 emoji.\n" + "    " * 7 + "\n"
    long_document = unit * (MAX_PIECE_CHARS // len(unit) + 2)
    return [
        ("empty", ""),
        ("one space", " "),
        ("newline", "\n"),
        ("whitespace mix", "   \n\n\t\t  x \r\n \u00a0 \u3000 end  "),
        ("long space run", " " * 5000 + "x" + " " * 3000),
        ("long newline run", "\n" * 3000 + "x\n\n"),
        ("long tab run", "\t" * 2000 + "y"),
        ("code", code * 20),
        ("numbers", "1234567890 3.14159 1,000,000 0x1F 1e-10 ٣٤٥ ½"),
        ("combining marks", "Cafe\u0301 nai\u0308ve A\u030a \u212b Å e\u0301\u0301\u0301 \u0301 a\u0327"),
        ("Hangul", "한국어 \u1100\u1161\u11a8 \uac00"),
        ("compatibility", "ﬁﬂ ① ² ｆｕｌｌ ㎏ ™"),
        ("emoji", "👍🏽 👨‍👩‍👧‍👦 🇫🇷🇩🇪 😀😀😀 ❤️ \U0001f9d1\u200d\U0001f4bb"),
        ("CJK", "漢字かなカナ、中文字符。日本語のテキスト"),
        ("right-to-left", "שלום עולם مرحبا بالعالم \u202eabc\u202c"),
        ("Devanagari", "नमस्ते दुनिया"),
        ("control characters", "a\x00b\x01c\x7fd\x1b[0m\u200be\ufefff"),
        ("added tokens in text", " ".join(f"x{t}y {t}{t} {t}" for t in added) + " plain"),
        ("added tokens alone", "".join(added)),
        ("vocabulary pieces", " ".join(pieces)),
        ("vocabulary pieces joined", "".join(pieces)),
        ("random characters", "".join(rng.choice(pool) for _ in range(8000))),
        ("document over the long-document cut", long_document),
    ]


def fast_backend_problem(tokenizer: Tokenizer, text: str | None = None) -> str | None:
    """Why fastokens cannot encode for ``tokenizer`` (whose JSON is ``text`` when given) exactly
    (it is not installed, refuses the tokenizer, or gives other ids than the reference on a
    self-check sample), or None."""
    text = tokenizer.to_str() if text is None else text
    fingerprint = tokenizer_fingerprint(tokenizer, text)
    if fingerprint not in _SELF_CHECKS:   # once per tokenizer and process: every build plans
        _SELF_CHECKS[fingerprint] = _fast_backend_problem(tokenizer, text)
    return _SELF_CHECKS[fingerprint]


_SELF_CHECKS: dict[str, str | None] = {}   # tokenizer fingerprint -> fast_backend_problem


def _fast_backend_problem(tokenizer: Tokenizer, text: str) -> str | None:
    try:
        fast = DocumentEncoder(tokenizer, backend="fastokens", text=text)
    except ImportError as exc:
        return f"fastokens is not installed ({exc})"
    except ValueError as exc:
        return f"fastokens cannot load this tokenizer ({exc})"
    named = _self_check_texts(tokenizer)
    texts = [text for _, text in named]
    fast_ids, fast_lengths = fast.encode(texts, verify=False)
    reference = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    bounds = np.concatenate([[0], np.cumsum(fast_lengths)])
    for i, ((name, _), encoding) in enumerate(zip(named, reference)):
        mismatch = _first_difference(encoding.ids, fast_ids[bounds[i]:bounds[i + 1]])
        if mismatch:
            return f"{fast.name} disagrees with {encoder_name('hf')} on the self-check sample {name!r} ({mismatch})"
    return None


def _first_difference(expected: list[int], got: np.ndarray) -> str | None:
    """Where ids ``got`` first differ from ``expected``, in words; None when equal."""
    got_list = got.tolist()
    if got_list == expected:
        return None
    at = next((k for k, (a, b) in enumerate(zip(expected, got_list)) if a != b), min(len(expected), len(got_list)))
    return (f"{len(expected)} reference ids, {len(got_list)} fast ids; first difference at token {at}: "
            f"{expected[at:at + 3]} vs {got_list[at:at + 3]}")


def resolve_backend(tokenizer: Tokenizer, backend: str, spec: str, text: str | None = None) -> str:
    """The backend that encodes for ``tokenizer`` (``spec``: the config's ``tokenizer``; ``text``:
    its JSON when the caller has it) under the config's ``tokenizer_backend``: ``hf`` as asked;
    ``fastokens`` when it loads the tokenizer and passes the self-check, else a ConfigError naming
    the key; ``auto``: fastokens when it passes, else ``hf`` with one log line saying why."""
    if backend == "hf":
        return "hf"
    problem = fast_backend_problem(tokenizer, text)
    if problem is None:
        return "fastokens"
    if backend == "fastokens":
        raise ConfigError(
            f"tokenizer_backend: fastokens cannot be used for tokenizer {spec!r}: {problem}; "
            "set tokenizer_backend: auto (falls back to hf) or hf"
        )
    log.info("tokenizer_backend auto: encoding with %s, not fastokens: %s", encoder_name("hf"), problem)
    return "hf"


class DocumentEncoder:
    """Batched encoding of documents without special tokens, exactly as whole-document encoding.

    ``backend`` ``hf`` encodes with the ``tokenizers`` tokenizer: documents longer than
    :data:`MAX_PIECE_CHARS` are cut at points where the tokenizer's pre-tokenizer starts a new
    pre-token, encoded as pieces in one batch and merged back; the result equals encoding the
    whole document. Tokenizers for which such cuts are not exact (a normalizer, a prefix space
    added to every input) encode long documents whole. ``backend`` ``fastokens`` encodes whole
    documents with fastokens (ImportError or ValueError when it cannot load the tokenizer) and
    checks one document of every batch against ``tokenizers``. ``text``: the tokenizer's JSON when
    the caller has it (fastokens loads from it; otherwise ``tokenizer.to_str()`` is produced).
    """

    def __init__(self, tokenizer: Tokenizer, max_piece_chars: int = MAX_PIECE_CHARS, backend: str = "hf",
                 text: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_piece_chars = max_piece_chars
        self.dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
        self.backend = backend
        self.name = encoder_name(backend)
        self._fast = _fast_tokenizer(tokenizer, text) if backend == "fastokens" else None
        self.splits_long_documents = backend == "hf" and self._cuts_are_exact()

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

    def encode(self, texts: list[str], verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of ``texts`` concatenated, and each text's token count (no special tokens).

        With the fastokens backend and ``verify``, one text of the batch (the longest of at most
        :data:`VERIFY_SAMPLE_CHARS` characters) is encoded by ``tokenizers`` too; other ids raise
        :class:`EncoderMismatchError`."""
        if self._fast is not None:
            ids, lengths = self._encode_fast(texts)
            if verify:
                self._verify_sample(texts, ids, lengths)
            return ids, lengths
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

    def _encode_fast(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        flat, offsets = self._fast.encode_batch_flat(texts, add_special_tokens=False)  # type: ignore[attr-defined]
        ids = np.frombuffer(flat, dtype="<u4")
        bounds = np.frombuffer(offsets, dtype="<u8")
        return (ids if self.dtype == np.uint32 else ids.astype(self.dtype)), np.diff(bounds).astype(np.int64)

    def _verify_sample(self, texts: list[str], ids: np.ndarray, lengths: np.ndarray) -> None:
        candidates = [i for i, text in enumerate(texts) if len(text) <= VERIFY_SAMPLE_CHARS]
        if not candidates:
            return
        pick = max(candidates, key=lambda i: len(texts[i]))
        start = int(lengths[:pick].sum())
        mismatch = _first_difference(self._ids(texts[pick]), ids[start:start + int(lengths[pick])])
        if mismatch:
            raise EncoderMismatchError(
                f"{self.name} gave other ids than {encoder_name('hf')} for text {pick} of the batch "
                f"({len(texts[pick])} characters, starting {texts[pick][:40]!r}): {mismatch}; the chunk "
                "was not written. Set tokenizer_backend: hf and build again, and report the text to fastokens"
            )
