"""The plain specs the index maps take, and their identities in the catalog.

- :class:`MixtureSpec`: the datasets a mixture draws from, its stages of weights, batch size, stop
  strategy and seed (``mixture_id`` names it in the catalog's ``mixtures`` table);
- :class:`PackingSpec`: what decides a chunk's packing plan (``plan_key`` names it in
  ``packing_plans`` and ``chunk_examples``);
- :class:`Template` (with :class:`Fim` or :class:`Infill`): the token ids a dataset's documents are
  rendered with.

They are built from a config in one place, :mod:`lakeloader.specs`; the maps over them are in
:mod:`lakeloader.index`. Weights are validated here and nowhere else (:func:`check_weights`), and
quantised here (:func:`quantized_weights`): the integers every count of the schedule uses.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import numbers
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

SCALE_BITS = 40
STOP_STRATEGIES = ("restart", "first_exhausted", "all_exhausted")
# The [rows, seq_len] fields of a training batch; ``loader.fields`` chooses which a loader makes
# (input ids and targets always).
ROW_FIELDS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")
REQUIRED_ROW_FIELDS = ("input_ids", "targets")


# -- keys ------------------------------------------------------------------------------------------

def derive_key(*parts: int | str) -> int:
    """A 64-bit key (an int in ``[0, 2**64)``) from ``parts`` (ints and strings).

    Stable across processes, Python versions and platforms (blake2b over a typed,
    length-prefixed encoding, so ``("ab", 1)`` and ``("a", "b1")`` differ).
    """
    hasher = hashlib.blake2b(digest_size=8, person=b"lakeloader-key")
    for part in parts:
        if isinstance(part, str):
            tag, data = b"s", part.encode("utf-8")
        elif isinstance(part, numbers.Integral):
            tag, data = b"i", str(int(part)).encode("ascii")
        else:
            raise TypeError(f"derive_key parts must be int or str, got {type(part).__name__}: {part!r}")
        hasher.update(tag + len(data).to_bytes(8, "little") + data)
    return int.from_bytes(hasher.digest(), "little")


# -- mixtures --------------------------------------------------------------------------------------

class WeightError(ValueError):
    """Invalid mixture weights; ``position`` is the offending weight's position (None: all of them)."""

    def __init__(self, message: str, position: int | None = None) -> None:
        super().__init__(message)
        self.position = position


def check_weights(weights: Sequence[float], names: Sequence[str] | None = None) -> tuple[float, ...]:
    """``weights`` as floats; raises :class:`WeightError` unless every one is a finite number >= 0
    and at least one is > 0. ``names`` (the datasets weighed) word the error."""
    try:
        values = tuple(float(w) for w in weights)
    except (TypeError, ValueError) as exc:
        raise WeightError(f"mixture weights must be numbers, got {list(weights)!r}") from exc
    if not values:
        raise WeightError("mixture weights are empty: give at least one dataset weight")
    for i, w in enumerate(values):
        if not math.isfinite(w) or w < 0:
            which = f"of dataset {names[i]!r}" if names is not None else str(i)
            raise WeightError(f"mixture weight {which} is {w!r}; weights must be finite and >= 0", i)
    if not any(values):
        shown = dict(zip(names, values)) if names is not None else list(values)
        raise WeightError(f"mixture weights are all zero ({shown}); at least one must be > 0")
    return values


@functools.lru_cache(maxsize=256)
def _quantize(values: tuple[float, ...]) -> tuple[int, ...]:
    exact = [Fraction(w) for w in values]
    total = sum(exact)
    # Nearest integer of w / total * 2**40, at least 1 for a positive weight.
    return tuple(max(1, math.floor(w / total * (1 << SCALE_BITS) + Fraction(1, 2))) if w else 0 for w in exact)


def quantized_weights(weights: Sequence[float]) -> tuple[int, ...]:
    """The integer weights the schedule really uses (about ``w_d / sum(w) * 2**40``; zero
    exactly for zero weights, >= 1 for positive ones). Raises ValueError on invalid weights."""
    return _quantize(check_weights(weights))


def check_batch_size(batch_size: int) -> int:
    """``batch_size`` as an int; ValueError unless it is a positive integer."""
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


@dataclasses.dataclass(frozen=True)
class Stage:
    """Mixture ``weights`` (one per dataset, same order in every stage) from global batch
    ``start_step`` until the next stage starts."""

    start_step: int
    weights: Sequence[float]

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", check_weights(self.weights))
        if int(self.start_step) != self.start_step or self.start_step < 0:
            raise ValueError(f"stage start_step must be an integer >= 0, got {self.start_step!r}")


def check_stages(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """``stages`` as a tuple; ValueError unless the first starts at step 0, start steps strictly
    increase and every stage weighs the same datasets."""
    stages = tuple(stages)
    if not stages:
        raise ValueError("a mixture needs at least one stage")
    if stages[0].start_step != 0:
        raise ValueError(f"the first stage must start at step 0, got start_step {stages[0].start_step}")
    starts = [s.start_step for s in stages]
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"stage start_step values must strictly increase, got {starts}")
    sizes = {len(s.weights) for s in stages}
    if len(sizes) != 1:
        raise ValueError(f"every stage must weigh the same datasets; got {sorted(sizes)} weights")
    return stages


@dataclasses.dataclass(frozen=True)
class MixtureSpec:
    """A mixture: the datasets it draws from (``names``), their staged weights (in examples), the
    global batch size, the stop strategy and the seed of the positions within a batch."""

    names: tuple[str, ...]
    stages: tuple[Stage, ...]
    batch_size: int
    stop: str
    seed: int

    def __post_init__(self) -> None:
        stages = check_stages(self.stages)
        if len(stages[0].weights) != len(self.names):
            raise ValueError(f"{len(self.names)} datasets {list(self.names)} but {len(stages[0].weights)} "
                             "weights per stage")
        check_batch_size(self.batch_size)
        if self.stop not in STOP_STRATEGIES:
            raise ValueError(f"unknown stop strategy {self.stop!r}; use one of {', '.join(STOP_STRATEGIES)}")
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "stages", stages)

    @property
    def mixture_id(self) -> str:
        """The mixture's id in the catalog (table ``mixtures``): a hash of the dataset names, each
        stage's start step and quantised weights, the batch size and the stop strategy."""
        payload = {
            "datasets": list(self.names),
            "stages": [[s.start_step, list(quantized_weights(s.weights))] for s in self.stages],
            "batch_size": self.batch_size,
            "stop": self.stop,
        }
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]

    @property
    def single(self) -> bool:
        """Whether the mixture draws from one dataset only."""
        return len(self.names) == 1


# -- templates -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Fim:
    """Fill-in-the-middle: a fraction ``rate`` of documents, cut at two seeded token positions."""

    rate: float
    spm_rate: float
    prefix: int            # sentinel token ids
    middle: int
    suffix: int
    key: int               # seeds which documents and where (per dataset)


@dataclasses.dataclass(frozen=True)
class Infill:
    """Infilling: a fraction ``rate`` of documents, each with ``gaps`` (min, max) seeded gaps of
    ``gap_tokens`` (min, max) tokens, rendered as ``[cls] masked document [sep]`` then per gap
    ``[cls] [start] content end`` (``cls_each``: the classification token before each gap's
    content rather than before the masked document). Absent tokens are None."""

    rate: float
    gaps: tuple[int, int]
    gap_tokens: tuple[int, int]
    mask: int              # token ids
    sep: int | None
    start: int | None
    end: int
    cls: int | None
    cls_each: bool
    key: int               # seeds which documents, how many gaps and where (per dataset)

    @property
    def fixed_tokens(self) -> int:
        """Tokens an infilled document gets whatever its gaps: the classification token before
        the masked document, the separator."""
        return int(self.cls is not None and not self.cls_each) + int(self.sep is not None)

    @property
    def gap_overhead(self) -> int:
        """Tokens each gap adds: its mask and end token, and its start and classification tokens
        where set."""
        return 2 + int(self.start is not None) + int(self.cls is not None and self.cls_each)


@dataclasses.dataclass(frozen=True)
class ImageResolution:
    """How an image becomes pixels and placeholder tokens (``interleaved.resolution``).

    ``fixed``: every image resized to fit ``size`` (height, width) keeping its aspect, padded, and
    given the template's fixed count of placeholders. ``patches``: every image resized to a grid
    of ``patch_size`` patches keeping its aspect, with at least ``min_pixels`` and at most
    ``max_pixels`` pixels and at most ``max_patches`` patches, one placeholder per patch
    (:mod:`lakeloader.index.image_tokens`)."""

    kind: str                       # fixed | patches
    size: tuple[int, int] = (224, 224)
    patch_size: int = 14
    min_pixels: int = 0
    max_pixels: int = 0
    max_patches: int = 0

    @property
    def patch_cap(self) -> int:
        """The most patches an image may have under ``patches`` (at least 1)."""
        return max(1, min(self.max_patches, self.max_pixels // self.patch_size ** 2))

    @property
    def payload(self) -> dict[str, object]:
        """What decides pixels and tokens, as JSON (for fingerprints)."""
        if self.kind == "fixed":
            return {"kind": "fixed", "size": list(self.size)}
        return {"kind": "patches", "patch_size": self.patch_size, "min_pixels": self.min_pixels,
                "max_pixels": self.max_pixels, "max_patches": self.max_patches}


@dataclasses.dataclass(frozen=True)
class ImageRun:
    """An image's placeholder run whose length depends on the image (``patches`` resolution):
    ``token`` repeated once per patch of the image's grid, between the image kind's prefix and
    suffix."""

    token: int
    resolution: ImageResolution


@dataclasses.dataclass(frozen=True, eq=False)
class Template:
    """Token ids added at collation around documents and around each part kind.

    ``part_trains[k]``: whether the content and suffix of parts of kind ``k`` are training
    targets (prefixes never are, unless ``train_all``). The document suffix trains when its
    last part does. ``train_all`` (plain text) makes every token a target, but for an infilled
    document's prompt side (``infill``): its document prefix, masked text and special tokens.
    """

    kind_names: tuple[str, ...]
    doc_prefix: np.ndarray
    doc_suffix: np.ndarray
    part_prefix: tuple[np.ndarray, ...]
    part_suffix: tuple[np.ndarray, ...]
    part_trains: tuple[bool, ...]
    train_all: bool = True
    fim: Fim | None = None
    image_kind: int | None = None     # kind whose parts are images (interleaved)
    infill: Infill | None = None
    image_run: ImageRun | None = None  # placeholders per image from its size (else in part_prefix)

    @functools.cached_property
    def doc_overhead(self) -> int:
        """Tokens added to every document."""
        return len(self.doc_prefix) + len(self.doc_suffix)

    @functools.cached_property
    def part_overhead(self) -> np.ndarray:
        """Tokens added around each part, per kind (int64)."""
        return np.array([len(p) + len(s) for p, s in zip(self.part_prefix, self.part_suffix)], np.int64)

    @functools.cached_property
    def counts_parts(self) -> bool:
        """Whether rendered lengths depend on how many parts of each kind a document has."""
        return bool(self.part_overhead.any())

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hash of everything that decides rendered tokens and their loss."""
        payload = {
            "kinds": list(self.kind_names), "doc": [self.doc_prefix.tolist(), self.doc_suffix.tolist()],
            "parts": [[p.tolist(), s.tolist()] for p, s in zip(self.part_prefix, self.part_suffix)],
            "trains": list(self.part_trains), "train_all": self.train_all,
            "fim": dataclasses.asdict(self.fim) if self.fim else None, "image_kind": self.image_kind,
        }
        if self.infill is not None:   # only then: the fingerprints of the other templates stay as they were
            payload["infill"] = dataclasses.asdict(self.infill)
        if self.image_run is not None:   # (likewise)
            payload["image_run"] = {"token": self.image_run.token, **self.image_run.resolution.payload}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def token_array(values: list[int] | np.ndarray) -> np.ndarray:
    """Token ids as a flat int32 array."""
    return np.asarray(values, dtype=np.int32).reshape(-1)


def make_template(kind_names: tuple[str, ...], *, bos: int | None, eos: int,
                  part_prefix: dict[str, list[int]] | None = None,
                  part_suffix: dict[str, list[int]] | None = None,
                  trains: set[str] | None = None, fim: Fim | None = None,
                  image_kind: str | None = None, infill: Infill | None = None,
                  image_run: ImageRun | None = None) -> Template:
    """A :class:`Template` from token ids per kind name (missing kinds add nothing); ``trains``
    None means every token trains (plain text, FIM, and infilling's plain documents)."""
    part_prefix, part_suffix = part_prefix or {}, part_suffix or {}
    return Template(
        kind_names=tuple(kind_names),
        doc_prefix=token_array([] if bos is None else [bos]), doc_suffix=token_array([eos]),
        part_prefix=tuple(token_array(part_prefix.get(k, [])) for k in kind_names),
        part_suffix=tuple(token_array(part_suffix.get(k, [])) for k in kind_names),
        part_trains=tuple(trains is None or k in trains for k in kind_names),
        train_all=trains is None, fim=fim,
        image_kind=None if image_kind is None else kind_names.index(image_kind), infill=infill,
        image_run=image_run,
    )


# -- packing ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class PackingSpec:
    """Everything that decides a chunk's packing plan (hashable into ``plan_key``)."""

    seq_len: int
    mode: str                   # pack | pad
    algorithm: str              # first_fit | best_fit
    open_examples: int          # examples a document may join (loader.pack.open_examples)
    long_documents: str         # truncate | split | error
    template: Template
    max_images: int | None = None

    @property
    def plan_key(self) -> str:
        """Id of this plan in the catalog."""
        # ("window" is open_examples' name from before it was renamed: kept, so that the plans
        # lakes hold are still found under their keys.)
        payload = {
            "seq_len": self.seq_len, "mode": self.mode, "algorithm": self.algorithm,
            "window": self.open_examples if self.mode == "pack" else None, "long_documents": self.long_documents,
            "template": self.template.fingerprint, "max_images": self.max_images,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        """The spec's settings for the catalog's ``packing_plans`` table (readable, not parsed)."""
        return json.dumps({
            "seq_len": self.seq_len, "mode": self.mode, "algorithm": self.algorithm, "open_examples": self.open_examples,
            "long_documents": self.long_documents, "template": self.template.fingerprint,
            "max_images": self.max_images,
        }, sort_keys=True)
