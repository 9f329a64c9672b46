"""The YAML config: keys of docs/design.md, validated, with errors naming file, line, key and allowed values."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from lakeloader.contracts.chunk_file import DOCUMENT_COLUMNS
from lakeloader.contracts.doc_keys import split_predicates
from lakeloader.contracts.errors import ConfigError
from lakeloader.contracts.formats import RecordFormat
from lakeloader.contracts.media import DEFAULT_MAX_PIXELS
from lakeloader.contracts.selection import PredicateError, check_predicate, metadata_columns, where_problem
from lakeloader.contracts.specs import REQUIRED_ROW_FIELDS, ROW_FIELDS, WeightError, check_weights
from lakeloader.storage import S3_PROTOCOLS, s3_options_problem

# The build's catalog file at a local lake's root; no dataset folder may take its name.
WRITER_CATALOG = "catalog.duckdb"
DEFAULT_IO_RETRY_DEADLINE = 120.0  # seconds of retrying unreachable object storage
MAX_INFILL_GAPS = 64   # collation draws [documents, max gaps] arrays: a bound keeps them small

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_PUBLIC_OPTION = re.compile(r"endpoint|region|url", re.IGNORECASE)   # storage options that are no secret
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Bytes of a size given as an int or a string such as ``64MB`` or ``1.5 GiB``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 64MB, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"size must be positive, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 64MB, 512KiB or 1GB, got {value!r}")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


class KeyValueError(ValueError):
    """A check over several keys failed at one key: ``path`` is that key's path below the model
    being validated, so the error names it and its YAML line like a field-level error."""

    def __init__(self, path: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.path = path


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoleTemplate(_Strict):
    """Text put around one chat message's content at collation (may contain special tokens)."""

    prefix: str = Field(default="", description="Text put before the message content.")
    suffix: str = Field(default="", description="Text put after the message content.")


def _chatml(roles: list[str]) -> dict[str, RoleTemplate]:
    return {role: RoleTemplate(prefix=f"<|im_start|>{role}\n", suffix="<|im_end|>\n") for role in roles}


class ChatFormat(_Strict):
    """``format: chat``: a list of messages with roles. Field keys are read at build time; the
    template and loss roles apply at collation (change them without rebuilding)."""

    messages_field: str = Field(default="messages", description="Record field holding the list of messages.")
    role_key: str = Field(default="role", description="Key of a message's role.")
    content_key: str = Field(default="content", description="Key of a message's text.")
    roles: list[str] = Field(default_factory=lambda: ["system", "user", "assistant", "tool"], min_length=1,
                             description="The roles a message may have (a part kind each).")
    template: dict[str, RoleTemplate] | None = Field(
        default=None, description="Prefix and suffix per role (default: ChatML for every role).")
    loss_roles: list[str] = Field(default_factory=lambda: ["assistant"],
                                  description="Roles whose tokens count in the loss.")

    @property
    def role_templates(self) -> dict[str, RoleTemplate]:
        """Prefix and suffix of each role (roles without an entry get none)."""
        return self.template if self.template is not None else _chatml(self.roles)

    @model_validator(mode="after")
    def _roles_known(self) -> ChatFormat:
        for key, names in (("template", list(self.template or {})), ("loss_roles", self.loss_roles)):
            unknown = sorted(set(names) - set(self.roles))
            if unknown:
                raise KeyValueError((key,), f"{key} names role(s) {unknown} that are not in roles {self.roles}")
        return self


class SupervisedFormat(_Strict):
    """``format: supervised``: a prompt and a response; loss on the response only.

    Rendered as ``prompt_prefix + prompt + separator + response + response_suffix`` (then EOS).
    ``output: seq2seq`` gives ``inputs`` (the prompt side) and ``targets`` (the response side)
    as separate arrays instead of one causal sequence."""

    prompt_field: str = Field(default="prompt", description="Record field holding the prompt.")
    response_field: str = Field(default="response", description="Record field holding the response.")
    prompt_prefix: str = Field(default="", description="Text put before the prompt.")
    separator: str = Field(default="<|sep|>", description="Text put between prompt and response.")
    response_suffix: str = Field(default="", description="Text put after the response (before EOS).")
    output: Literal["causal", "seq2seq"] = Field(
        default="causal", description="One causal sequence, or separate inputs and targets arrays.")


class FimFormat(_Strict):
    """``format: fim``: text documents of which a seeded fraction ``rate`` is cut into prefix,
    middle and suffix at collation and reordered (PSM, or SPM for a fraction ``spm_rate``)."""

    text_field: str | None = Field(default=None, description=(
        "Record field holding the text (default: the dataset's text_field)."))
    rate: float = Field(default=0.5, ge=0, le=1, description="Fraction of documents cut and reordered.")
    spm_rate: float = Field(default=0.0, ge=0, le=1,
                            description="Fraction of the reordered documents in SPM order (the rest PSM).")
    prefix_token: str = Field(default="<|fim_prefix|>", description="Token put before the prefix.")
    middle_token: str = Field(default="<|fim_middle|>", description="Token put before the middle.")
    suffix_token: str = Field(default="<|fim_suffix|>", description="Token put before the suffix.")


class InfillFormat(_Strict):
    """``format: infill``: text documents of which a seeded fraction ``rate`` gets seeded gaps at
    collation (arbitrary infilling, ILM): each gap replaced by ``mask_token``, then the gaps'
    contents after the masked document, trained on alone.

    Rendered as ``[cls_token] masked document [sep_token]`` then, per gap, ``[cls_token]
    [start_token] content end_token`` (then EOS); ``cls_position`` places the classification
    token before the masked document or before each gap's content. The loss covers each gap's
    content and end token, and EOS."""

    text_field: str | None = Field(default=None, description=(
        "Record field holding the text (default: the dataset's text_field)."))
    rate: float = Field(default=1.0, ge=0, le=1, description=(
        "Fraction of documents infilled (the others render as plain text, every token trained)."))
    gaps: list[int] = Field(default_factory=lambda: [1, 3], min_length=2, max_length=2, description=(
        f"[min, max] gaps per infilled document (an int: exactly that many; max at most "
        f"{MAX_INFILL_GAPS}), spread evenly over the range in each chunk; a document shorter than its "
        "gaps has empty ones."))
    gap_tokens: list[int] = Field(default_factory=lambda: [4, 32], min_length=2, max_length=2, description=(
        "[min, max] tokens per gap (an int: exactly that many), uniform, each at most the document's "
        "tokens over its number of gaps so that the gaps fit without overlapping."))
    mask_token: str = Field(default="<|mask|>", description="Token put in the document in place of each gap.")
    sep_token: str | None = Field(default="<|sep|>", description=(
        "Token put after the masked document, before the gaps' contents (null: none)."))
    start_token: str | None = Field(default=None, description=(
        "Token put before each gap's content (null: none)."))
    end_token: str = Field(default="<|answer|>", description="Token put after each gap's content (trained).")
    cls_token: str | None = Field(default=None, description="A classification token (null: none).")
    cls_position: Literal["prefix", "each_target"] = Field(default="prefix", description=(
        "Where cls_token goes: before the masked document, or before each gap's content."))

    @field_validator("gaps", "gap_tokens", mode="before")
    @classmethod
    def _one_int(cls, value: Any) -> Any:
        return [value, value] if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("gaps", "gap_tokens")
    @classmethod
    def _min_max(cls, value: list[int], info: ValidationInfo) -> list[int]:
        low, high = value
        if low < 1 or high < low:
            raise ValueError(f"give [min, max] with 1 <= min <= max, got {value}")
        if info.field_name == "gaps" and high > MAX_INFILL_GAPS:
            raise ValueError(f"at most {MAX_INFILL_GAPS} gaps per document, got {high}")
        return value


class ImageResolutionConfig(_Strict):
    """How stored images become pixels and placeholder tokens (``interleaved.resolution``):
    ``fixed`` resizes each image to fit ``size`` keeping its aspect and pads it (``image_tokens``
    placeholders each); ``patches`` resizes it to a grid of ``patch_size`` patches keeping its
    aspect, within ``min_pixels``..``max_pixels`` and at most ``max_patches`` patches, one
    placeholder per patch. Decided from the stored width and height alone: changing it re-plans,
    never rebuilds."""

    kind: Literal["fixed", "patches"] = Field(default="fixed", description="fixed | patches.")
    size: list[int] = Field(default=[224, 224], description="fixed: [height, width] of pixel_values.")
    patch_size: int = Field(default=14, ge=1, le=64, description="patches: pixels per patch side.")
    min_pixels: int = Field(default=56 * 56, ge=0, description="patches: fewest pixels an image is resized to.")
    max_pixels: int = Field(default=448 * 448, ge=1, description="patches: most pixels an image is resized to.")
    max_patches: int = Field(default=256, ge=1, description="patches: most patches (placeholder tokens) of an image.")

    @field_validator("size")
    @classmethod
    def _size(cls, value: list[int]) -> list[int]:
        if len(value) != 2 or min(value) < 1 or max(value) > 4096:
            raise ValueError(f"give [height, width], each in 1..4096, got {value}")
        return value

    @model_validator(mode="after")
    def _bounds(self) -> ImageResolutionConfig:
        if self.kind == "patches":
            if self.max_pixels < self.patch_size ** 2:
                raise KeyValueError(("max_pixels",), f"max_pixels {self.max_pixels} is less than one patch "
                                                      f"({self.patch_size}x{self.patch_size})")
            if self.min_pixels > self.max_pixels:
                raise KeyValueError(("min_pixels",), f"min_pixels {self.min_pixels} is more than max_pixels "
                                                      f"{self.max_pixels}")
        return self


class InterleavedFormat(_Strict):
    """``format: interleaved``: a list of items, each text or an image. Each image becomes
    ``image_start``, its placeholder tokens (``image_tokens`` of them, or one per patch under
    ``resolution: {kind: patches}``) and ``image_end`` at collation. With ``images: references``
    an image item is a reference string that travels with the example in ``image_refs``; with
    ``images: stored`` the build reads each image (bytes, a path or URL, a tar member), checks it
    and stores it in the lake, and the loader puts its pixels in the batch (``pixel_values`` or
    ``pixel_patches``, with ``image_mask``)."""

    items_field: str = Field(default="items", description="Record field holding the list of items.")
    text_key: str = Field(default="text", description="Key of a text item's text.")
    image_key: str = Field(default="image", description="Key of an image item's reference.")
    image_tokens: int = Field(default=64, ge=1, description="Placeholder tokens per image.")
    image_token: str = Field(default="<|image|>", description="The placeholder token of an image.")
    image_start: str = Field(default="<|image_start|>", description="Token put before an image's placeholders.")
    image_end: str = Field(default="<|image_end|>", description="Token put after an image's placeholders.")
    max_images: int = Field(default=8, ge=1, description="Images per example.")
    images: Literal["references", "stored"] = Field(default="references", description=(
        "references: an image item's value is a reference string kept as it is (no image is read). stored: "
        "the build reads each image (bytes in the record, a {bytes, path} struct as Hugging Face datasets "
        "write them, {\"bytes\": base64} in JSON Lines, a path or URL resolved through fsspec relative to "
        "the source file's folder, or a member of a WebDataset tar sample), checks it with Pillow and stores "
        "its original bytes in the chunk's media file."))
    max_pixels: int = Field(default=DEFAULT_MAX_PIXELS, ge=1, description=(
        "images: stored: an image of more pixels (width x height) is bad input (a decompression bomb), "
        "refused before its pixels are decoded."))
    resolution: ImageResolutionConfig = Field(
        default=ImageResolutionConfig(),
        description="Stored images: pixels in the batch and placeholders per image (fixed | patches).")

    @model_validator(mode="after")
    def _patches_need_stored_images(self) -> InterleavedFormat:
        if self.resolution.kind == "patches" and self.images != "stored":
            raise KeyValueError(("resolution", "kind"), "resolution kind 'patches' sizes each image from its stored "
                                                        "width and height: it needs images: stored")
        return self


FORMAT_SECTIONS = ("chat", "supervised", "fim", "infill", "interleaved")
# Columns of the catalog's documents view that no metadata field may shadow (with the prefix
# tokens_ of its per-kind token counts).
_METADATA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


SPLIT_PARTS = ("train", "validation")   # a split of dataset <name> adds datasets <name>.train, <name>.validation


class SplitConfig(_Strict):
    """``split``: a held-out part of a dataset, chosen by ``doc_key``. Dataset ``<name>`` with a
    split adds two datasets defined by a filter of it, ``<name>.train`` and ``<name>.validation``,
    with complementary predicates over doc_key: disjoint, and together exactly the documents of
    ``<name>``, on any machine and rebuild."""

    fraction: float = Field(gt=0, lt=1, description=(
        "The share of the documents held out in <name>.validation (the rest are <name>.train): those whose "
        "doc_key (mixed by the seed) is below fraction * 2^64, so the count is about fraction of the documents."))
    seed: int = Field(default=0, ge=0, description=(
        "Which documents are held out: another seed holds out another set of the same expected size "
        "(seed 0: doc_key < fraction * 2^64; another: doc_key times an odd number of the seed, modulo 2^64)."))

    def predicates(self) -> dict[str, str]:
        """The predicate over doc_key of each part (``SPLIT_PARTS``)."""
        return dict(zip(SPLIT_PARTS, split_predicates(self.fraction, self.seed)))


class DatasetConfig(_Strict):
    """One dataset: where its documents come from and how to read and render them."""

    sources: list[str] = Field(default_factory=list, description=(
        "Globs or URLs of input files (.jsonl[.gz|.zst], .txt[.gz|.zst], .parquet); one string is a list of "
        "one. Required unless the dataset is defined by a filter (from, where)."))
    from_: str | None = Field(default=None, alias="from", description=(
        "A dataset defined by a filter: the dataset of this config whose documents it selects (with "
        "where; no sources or format keys: it takes its source's). Built without tokenizing: the build "
        "evaluates where on each chunk of the source and stores the selection. The source may not "
        "itself be defined by a filter."))
    where: str | None = Field(default=None, description=(
        "With from: a SQL predicate over the source dataset's metadata fields, num_tokens and doc_key (the "
        "document's stable key, an unsigned 64-bit integer), e.g. \"lang = 'en' AND num_tokens < 8192\" or "
        "\"doc_key % 100 >= 1\" (one pure expression: no subquery)."))
    split: SplitConfig | None = Field(default=None, description=(
        "Hold out a part of this dataset: adds the datasets <name>.train and <name>.validation, filters of it "
        "(of its source, with its where, for a dataset defined by a filter) that split its documents by doc_key."))
    format: Literal["text", "chat", "supervised", "fim", "infill", "interleaved"] = Field(
        default="text", description="How records are read and rendered (the section of the same name configures it).")
    text_field: str = Field(default="text", description="Record field holding the text.")
    on_error: Literal["raise", "skip"] = Field(
        default="raise", description="Bad input stops the build, or is skipped into the rejects table.")
    chat: ChatFormat = Field(default=ChatFormat(), description="Settings of format: chat.")
    supervised: SupervisedFormat = Field(default=SupervisedFormat(), description="Settings of format: supervised.")
    fim: FimFormat = Field(default=FimFormat(), description="Settings of format: fim.")
    infill: InfillFormat = Field(default=InfillFormat(), description="Settings of format: infill.")
    interleaved: InterleavedFormat = Field(default=InterleavedFormat(), description="Settings of format: interleaved.")
    metadata_fields: dict[str, Literal["string", "int", "float", "bool"] | None] = Field(
        default_factory=dict, description=(
            "Record fields kept with each document for SQL (the documents view), not tokenized: a list "
            "of fields, or {field: type} with type string | int | float | bool. A field listed without "
            "a type takes that of its first value in the dataset's first file (its first 10,000 "
            "records, or its Parquet column). A missing field or null is NULL; a value of another type "
            "is bad input (on_error). A float field takes ints."))

    @field_validator("metadata_fields", mode="before")
    @classmethod
    def _metadata_list(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not all(isinstance(name, str) for name in value):
                raise ValueError("list the metadata fields by name, or map each to its type, e.g. "
                                 "{lang: string, score: float}")
            return dict.fromkeys(value)
        return value

    @field_validator("metadata_fields")
    @classmethod
    def _metadata_names(cls, value: dict[str, str | None]) -> dict[str, str | None]:
        for name in value:
            if not _METADATA_NAME.match(name):
                raise ValueError(f"metadata field name {name!r} must be letters, digits and _ (not first), "
                                 "so that SQL can name its column")
            if name in DOCUMENT_COLUMNS or name.startswith("tokens_"):
                raise ValueError(f"metadata field {name!r} would hide the documents view's column of that name "
                                 f"({', '.join(DOCUMENT_COLUMNS)}, tokens_<kind>); leave it out of metadata_fields")
        return value

    @field_validator("sources", mode="before")
    @classmethod
    def _one_source_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _sources_or_filter(self) -> DatasetConfig:
        if self.from_ is None:
            if self.where is not None:
                raise KeyValueError(("where",), "where filters the dataset named by from: add from: <dataset>")
            if not self.sources:
                raise KeyValueError(("sources",), "a dataset needs sources (globs or URLs of input files), "
                                    "or from and where to select documents of another dataset")
            return self
        if self.where is None:
            raise KeyValueError(("where",), f"a dataset defined by a filter of {self.from_!r} needs where: <SQL predicate>")
        others = sorted(set(self.model_fields_set) - {"from_", "where", "split"})
        if others:
            raise KeyValueError((others[0],), "a dataset defined by a filter (from, where) takes its documents, "
                                "format and fields from its source dataset; remove this key")
        return self

    @model_validator(mode="after")
    def _sections_match_format(self) -> DatasetConfig:
        for section in FORMAT_SECTIONS:
            if section in self.model_fields_set and section != self.format:
                raise KeyValueError(
                    (section,),
                    f"section {section!r} applies to format: {section}, but this dataset has format: "
                    f"{self.format}; remove the section or change the format")
        return self

    @property
    def seq2seq(self) -> bool:
        """Whether examples are (inputs, targets) pairs rather than one causal sequence."""
        return self.format == "supervised" and self.supervised.output == "seq2seq"

    @property
    def part_kinds(self) -> tuple[str, ...]:
        """The kinds of part the build stores for this format (``dataset_plans.fields``): a
        part's kind is its index here."""
        if self.format == "chat":
            return tuple(self.chat.roles)
        if self.format == "supervised":
            return ("prompt", "response")
        if self.format == "interleaved":
            return ("text", "image")
        return ("text",)

    @property
    def build_fields(self) -> dict[str, Any]:
        """The keys that decide what the build stores (part of the dataset fingerprint); the
        rest of the format's section is applied at collation and never needs a rebuild."""
        if self.format == "chat":
            return self.chat.model_dump(include={"messages_field", "role_key", "content_key", "roles"})
        if self.format == "supervised":
            return self.supervised.model_dump(include={"prompt_field", "response_field"})
        if self.format == "interleaved":
            # images and max_pixels only when stored: the fingerprints of reference datasets stay as they were.
            stored = {"images", "max_pixels"} if self.interleaved.images == "stored" else set()
            return self.interleaved.model_dump(include={"items_field", "text_key", "image_key", *stored})
        if self.format in ("fim", "infill"):
            section = self.fim if self.format == "fim" else self.infill
            return {"text_field": section.text_field or self.text_field}
        return {"text_field": self.text_field}

    def record_format(self) -> RecordFormat:
        """How the build turns this dataset's records into parts (only its build fields matter)."""
        items = ((k, tuple(v) if isinstance(v, list) else v) for k, v in self.build_fields.items())
        return RecordFormat(self.format, tuple(sorted(items)), self.part_kinds,
                            tuple(self.metadata_fields.items()))


class BuildConfig(_Strict):
    """How the lake is built."""

    split_size: int = Field(default=64 * 10**6, description=(
        "Bytes per split of an uncompressed file, an int or a size such as 64MB or 512KiB."))
    workers: int | None = Field(default=None, ge=1, description=(
        "Local Dask worker processes (default: one per core); unused with --scheduler."))
    row_group_tokens: int = Field(default=1 << 20, ge=1, description="Tokens per Parquet row group of a chunk.")
    publish_interval: float = Field(default=5.0, gt=0, description=(
        "Seconds between catalog snapshots published during a build."))
    # The dashboard is unauthenticated (task names, worker logs and stacks), so only this host
    # may reach it unless a user opens it, e.g. 0.0.0.0:8787.
    dashboard: str | None = Field(default="127.0.0.1:0", description=(
        "host:port of a local build's Dask dashboard (port 0: any free one; null: off)."))

    @field_validator("split_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        return parse_size(value)


class ShuffleConfig(_Strict):
    """How each dataset's examples are shuffled before mixing."""

    kind: Literal["none", "window", "block", "full"] = Field(default="none", description=(
        "Shuffle kind; `shuffle: window` is short for `shuffle: {kind: window}`."))
    window_chunks: int = Field(default=8, ge=1, description="Chunks shuffled together by kind: window.")
    block_size: int = Field(default=1024, ge=1, description="Examples per block of kind: block.")
    window_blocks: int = Field(default=16, ge=1, description="Blocks shuffled together by kind: block.")


class PackConfig(_Strict):
    """How ``packing: pack`` fills examples with whole documents (``pad`` uses ``long_documents``)."""

    algorithm: Literal["first_fit", "best_fit"] = Field(
        default="first_fit", description="Which open example a document joins.")
    open_examples: int = Field(default=64, ge=1, description=(
        "Examples still open (with room left) that a document may join; the earliest closes when one more opens."))
    long_documents: Literal["truncate", "split", "error"] = Field(
        default="split", description="What happens to documents longer than seq_len.")


class LoaderConfig(_Strict):
    """How examples and batches are formed."""

    seq_len: int = Field(default=2048, ge=1, description="Tokens per example.")
    batch_size: int = Field(default=256, ge=1, description="Examples per global batch (over all processes).")
    packing: Literal["concat", "pack", "pad"] = Field(default="concat", description=(
        "How documents fill examples: cut a concatenated stream, pack whole documents, or one document each."))
    pack: PackConfig = Field(default=PackConfig(), description="Settings of packing: pack (and long documents of pad).")
    shuffle: ShuffleConfig = Field(default=ShuffleConfig(), description="How each dataset's examples are shuffled.")
    seed: int = Field(default=0, description="Seed of shuffles, mixture and FIM choices.")
    eos_token: str = Field(default="<|endoftext|>", description="Appended to every document at collation.")
    bos_token: str | None = Field(default=None, description="Prepended to every document when set.")
    pad_token: str | None = Field(default=None, description="Token used for padding (default: the EOS token).")
    ordering: Literal["global", "strided"] = Field(default="global", description=(
        "Order of examples over readers; strided needs packing: concat."))
    ideal_readers: int = Field(default=8, ge=1, description="R* of the strided ordering.")
    wait_timeout: float = Field(default=600.0, gt=0, description="Seconds to wait for an uncommitted chunk.")
    prefetch: int = Field(default=2, ge=0, description="Batches built ahead, in order, by one background thread (from an object store, by this many threads, so that their downloads overlap), ready while the training step runs (it pays off when the step releases the GIL, as a JAX step does). With one thread, a consumer that asks again at once builds its batches itself, sparing the handoff; 0 builds each batch when asked, always.")
    workers: int = Field(default=0, ge=0, le=256, description=(
        "Worker processes building batches into shared memory (0: in this process); same batches."))
    verify: Literal["checksum", "size"] = Field(default="checksum", description=(
        "How each chunk file is checked once before use: its size, and with checksum its sha256 (hashed "
        "once per process, and for a local lake once per machine while the file is unchanged); page "
        "checksums are checked on every read, and with size a file whose footer or page headers (which "
        "no checksum covers) the catalog cannot vouch for is hashed before it is read."))
    fields: list[Literal["input_ids", "targets", "loss_mask", "segment_ids", "positions"]] = Field(
        default=list(ROW_FIELDS), description=(
            "The [rows, seq_len] fields each batch holds (input_ids and targets always); a field left out "
            "is not computed, copied or sent to the devices. Leave out segment_ids and positions only "
            "where the model attends across documents and numbers positions itself."))
    cache_bytes: int = Field(default=256 * 2**20, description=(
        "Bytes of decoded row groups kept in memory (a size): about 2 bytes per token when the "
        "vocabulary fits 16 bits, least recently used first out."))
    disk_cache_bytes: int = Field(default=10 * 2**30, description=(
        "Bytes of local copies of a remote lake's chunk files (a size)."))
    image_cache_bytes: int = Field(default=128 * 2**20, description=(
        "Bytes of decoded and resized stored images kept in memory (a size), least recently used first out."))

    @field_validator("cache_bytes", "disk_cache_bytes", "image_cache_bytes", mode="before")
    @classmethod
    def _cache_size(cls, value: Any) -> int:
        return parse_size(value)

    @field_validator("shuffle", mode="before")
    @classmethod
    def _shuffle_shorthand(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value

    @field_validator("fields")
    @classmethod
    def _fields(cls, value: list[str]) -> list[str]:
        missing = [name for name in REQUIRED_ROW_FIELDS if name not in value]
        if missing:
            raise ValueError(f"must include {' and '.join(missing)} (every batch has input_ids and targets)")
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"names {', '.join(repeated)} more than once")
        return [name for name in ROW_FIELDS if name in value]   # in the batch's order, whatever the list's


class SqlConfig(_Strict):
    """Limits of the SQL run on a lake's catalog by readers: ``lakeloader sql`` and ``stats``
    (``Lake.sql``, ``Lake.stats``), and the catalog queries of status, audit and loaders. A lake
    path instead of a config gets the defaults."""

    memory_limit: int = Field(default=4 * 10**9, description=(
        "Memory the DuckDB database of one catalog reader may use (a size); nothing spills to disk, so "
        "a query that needs more stops with an error naming this key."))
    threads: int | None = Field(default=None, ge=1, description=(
        "Threads one catalog reader's queries run on (null: one per core, at most 4)."))
    timeout_s: float | None = Field(default=300.0, gt=0, description=(
        "Seconds a query of `lakeloader sql` or `stats` (Lake.sql, Lake.stats) may run before it is "
        "stopped with an error naming this key (null: no limit). Ctrl-C stops one at once."))

    @field_validator("memory_limit", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> int:
        return parse_size(value)


class StageConfig(_Strict):
    """Mixture weights from ``start_step`` on."""

    start_step: int = Field(ge=0, description="First step of the stage (the first stage starts at 0).")
    weights: dict[str, float] = Field(description="Weight of each dataset in the stage.")


class MixtureConfig(_Strict):
    """Weights (or stages of weights) over datasets, and what happens when one runs out."""

    weights: dict[str, float] | None = Field(default=None, description=(
        "Weight of each dataset (>= 0, not all 0); give this or stages."))
    stages: list[StageConfig] | None = Field(default=None, description="Weights that change at given steps.")
    stop: Literal["restart", "first_exhausted", "all_exhausted"] = Field(
        default="restart", description="What happens when a dataset runs out.")
    unit: Literal["examples", "tokens"] = Field(
        default="examples", description="Weights count examples or non-padding tokens.")

    @model_validator(mode="after")
    def _weights_or_stages(self) -> MixtureConfig:
        if (self.weights is None) == (self.stages is None):
            raise ValueError("give exactly one of 'weights' or 'stages'")
        if self.stages is not None:
            if not self.stages or self.stages[0].start_step != 0:
                raise KeyValueError(("stages", 0, "start_step") if self.stages else ("stages",),
                                    "the first stage must have start_step: 0")
            steps = [stage.start_step for stage in self.stages]
            if steps != sorted(set(steps)):
                raise KeyValueError(("stages",), f"stage start_step values must increase, got {steps}")
        for path, weights in self.weight_paths():
            names = list(weights)
            try:
                check_weights(list(weights.values()), names)
            except WeightError as exc:
                raise KeyValueError(path if exc.position is None else (*path, names[exc.position]), str(exc)) from None
        return self

    def weight_paths(self) -> list[tuple[tuple[str | int, ...], dict[str, float]]]:
        """Every weight mapping of the mixture with its key path below ``mixture``."""
        if self.weights is not None:
            return [(("weights",), self.weights)]
        return [(("stages", i, "weights"), stage.weights) for i, stage in enumerate(self.stages or [])]

    def all_weights(self) -> list[dict[str, float]]:
        """Every weight mapping of the mixture, one per stage."""
        return [weights for _, weights in self.weight_paths()]


class EvaluationConfig(_Strict):
    """The evaluation pass a loader of ``mode="eval"`` reads: one pass over each dataset listed."""

    datasets: list[str] = Field(min_length=1, description=(
        "The datasets of the pass, in order: each read once, every document exactly once (a dataset "
        "read only here needs no mixture weight)."))
    batch_size: int | None = Field(default=None, ge=1, description=(
        "Examples per global batch of the pass (default: loader.batch_size)."))
    seq_len: int | None = Field(default=None, ge=1, description=(
        "Tokens per example of the pass (default: loader.seq_len); under pack or pad the build "
        "registers the pass's packing too."))
    prompts: bool = Field(default=False, description=(
        "Yield the prompt side only, for a generation eval: each row's document cut before its first "
        "training target (a response, an infilled gap) into input_ids (the prompt), prompt_lengths, "
        "references and reference_lengths. Needs loader.packing: pad."))

    @field_validator("datasets")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"names {', '.join(repeated)} more than once: a pass reads each dataset once")
        return value


class Config(_Strict):
    """A whole lakeloader config. Relative paths are resolved against the config file's folder."""

    lake: str = Field(description="Local folder or fsspec URL of the lake (s3://bucket/prefix).")
    tokenizer: str = Field(description="A tokenizers JSON file, or a Hugging Face hub name.")
    tokenizer_backend: Literal["auto", "hf", "fastokens"] = Field(default="auto", description=(
        "What encodes the documents: hf (Hugging Face tokenizers, the reference), fastokens (faster, "
        "same ids; an error if it cannot load the tokenizer or fails the self-check against hf), "
        "auto (fastokens when it can, else hf). The encoder and its version are part of the "
        "dataset's fingerprint: changing either re-tokenizes the dataset."))
    datasets: dict[str, DatasetConfig] = Field(min_length=1, description=(
        "The datasets by name (letters, digits, _ . -; it names folders in the lake)."))
    storage_options: dict[str, Any] = Field(default_factory=dict, description=(
        "fsspec options of the lake's and sources' filesystems; credentials are never shown. With an "
        "s3:// lake or source they are checked when the config loads: s3fs's options, client_kwargs "
        "of a botocore client, config_kwargs of botocore's Config, s3_additional_kwargs of S3 requests."))
    io_retry_deadline: float = Field(default=DEFAULT_IO_RETRY_DEADLINE, ge=0, description=(
        "Seconds of retrying unreachable storage."))
    build: BuildConfig = Field(default=BuildConfig(), description="How the lake is built.")
    loader: LoaderConfig = Field(default=LoaderConfig(), description="How examples and batches are formed.")
    mixture: MixtureConfig | None = Field(default=None, description=(
        "Weights over datasets; needed with more than one dataset (default: the one dataset, weight 1)."))
    evaluation: EvaluationConfig | None = Field(default=None, description=(
        "The evaluation pass of Loader(config, mode='eval') (default: one pass over the mixture's datasets)."))
    sql: SqlConfig = Field(default=SqlConfig(), description="Limits of the SQL readers run on the catalog.")
    source_file: str | None = Field(default=None, exclude=True)

    def redact(self, text: str) -> str:
        """``text`` with every string value of ``storage_options`` (credentials, at any depth;
        endpoints and regions excepted) replaced by ``***``: for messages stored or shown beyond
        this process."""
        def strings(value: Any) -> list[str]:
            if isinstance(value, dict):
                return [s for key, item in value.items() if not _PUBLIC_OPTION.search(str(key))
                        for s in strings(item)]
            if isinstance(value, (list, tuple)):
                return [s for item in value for s in strings(item)]
            return [value] if isinstance(value, str) and len(value) >= 4 else []

        for secret in sorted(strings(self.storage_options), key=len, reverse=True):
            text = text.replace(secret, "***")
        return text

    @field_validator("datasets")
    @classmethod
    def _dataset_names(cls, value: dict[str, DatasetConfig]) -> dict[str, DatasetConfig]:
        for name in value:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
                raise KeyValueError(
                    (name,),
                    f"dataset name {name!r} must start with a letter or digit and contain only "
                    "letters, digits, '_', '.' or '-' (it names folders in the lake)"
                )
            if name.lower().startswith(WRITER_CATALOG):
                raise ValueError(
                    f"dataset name {name!r} collides with the lake's catalog file {WRITER_CATALOG} "
                    "(its files sit beside the dataset folders): rename the dataset"
                )
        return value

    @model_validator(mode="after")
    def _splits_add_datasets(self) -> Config:
        # Runs before the filters are checked: the parts of a split are datasets defined by a filter.
        for name, dataset in list(self.datasets.items()):
            if dataset.split is None:
                continue
            source, where = name, None
            if dataset.from_ is not None:   # a filter's parts filter its source, both predicates joined
                source = dataset.from_
                origin = self.datasets.get(source)
                if origin is None or origin.from_ is not None:
                    continue   # refused below, naming datasets.<name>.from
                try:   # as DuckDB prints it back: parentheses balanced, no comment, so AND binds it whole
                    where = check_predicate(dataset.where or "", metadata_columns(origin.metadata_fields))
                except PredicateError as exc:
                    raise KeyValueError(("datasets", name, "where"), str(exc)) from None
            for part, predicate in dataset.split.predicates().items():
                part_name = f"{name}.{part}"
                if part_name in self.datasets:
                    raise KeyValueError(("datasets", name, "split"),
                                        f"the split adds dataset {part_name!r}, which this config defines already: "
                                        f"rename that dataset or remove the split")
                self.datasets[part_name] = DatasetConfig.model_validate(
                    {"from": source, "where": predicate if where is None else f"({where}) AND ({predicate})"})
        return self

    def split_of(self, name: str) -> tuple[str, str] | None:
        """(dataset, part) if dataset ``name`` is a part of another's split, else None."""
        base, _, part = name.rpartition(".")
        dataset = self.datasets.get(base)
        return (base, part) if part in SPLIT_PARTS and dataset is not None and dataset.split is not None else None

    @model_validator(mode="after")
    def _filters_name_datasets(self) -> Config:
        for name, dataset in self.datasets.items():
            if dataset.from_ is None:
                continue
            source = self.datasets.get(dataset.from_)
            if source is None:
                raise KeyValueError(("datasets", name, "from"),
                                    f"no dataset {dataset.from_!r} in this config; datasets are {sorted(self.datasets)}")
            if source.from_ is not None:
                raise KeyValueError(("datasets", name, "from"),
                                    f"dataset {dataset.from_!r} is itself defined by a filter: filter its source "
                                    f"{source.from_!r} with both predicates joined by AND")
            problem = where_problem(dataset.where or "", source.metadata_fields)
            if problem is not None:
                raise KeyValueError(("datasets", name, "where"), problem)
        # A filtered dataset reads, renders and packs as its source does: it takes the source's
        # settings (every reader then treats it as an ordinary dataset) and keeps from and where.
        for name, dataset in list(self.datasets.items()):
            if dataset.from_ is not None:
                self.datasets[name] = self.datasets[dataset.from_].model_copy(
                    update={"from_": dataset.from_, "where": dataset.where, "split": dataset.split})
        return self

    @model_validator(mode="after")
    def _evaluation_names_datasets(self) -> Config:
        evaluation = self.evaluation
        if evaluation is None:
            return self
        for i, name in enumerate(evaluation.datasets):
            if name not in self.datasets:
                raise KeyValueError(("evaluation", "datasets", i),
                                    f"no dataset {name!r} in this config; datasets are {sorted(self.datasets)}")
        if evaluation.prompts:
            if self.loader.packing != "pad":
                raise KeyValueError(("evaluation", "prompts"), (
                    f"needs loader.packing: pad (one document a row, from position 0), not {self.loader.packing!r}"))
            if "segment_ids" not in self.loader.fields:
                raise KeyValueError(("evaluation", "prompts"), "needs segment_ids among loader.fields (a row's length)")
            seq2seq = [n for n in evaluation.datasets if self.datasets[n].seq2seq]
            if seq2seq:
                raise KeyValueError(("evaluation", "prompts"), (
                    f"datasets {seq2seq} are seq2seq: their batches hold the prompt side already (inputs)"))
        if self.loader.packing != "concat" and evaluation.seq_len not in (None, self.loader.seq_len):
            mixed = {n for weights in (self.mixture.all_weights() if self.mixture else [{n: 1 for n in self.datasets}])
                     for n, w in weights.items() if w > 0}
            both = [n for n in evaluation.datasets if n in mixed]
            if both:
                raise KeyValueError(("evaluation", "seq_len"), (
                    f"datasets {both} are both mixed and evaluated, and under loader.packing: {self.loader.packing} "
                    f"a dataset is packed once, at loader.seq_len {self.loader.seq_len}: leave evaluation.seq_len out, "
                    "or evaluate datasets of their own (a held-out split)"))
        return self

    @model_validator(mode="after")
    def _mixture_names_datasets(self) -> Config:
        if self.mixture is None:
            return self
        for path, weights in self.mixture.weight_paths():
            unknown = sorted(set(weights) - set(self.datasets))
            if unknown:
                raise KeyValueError(
                    ("mixture", *path, unknown[0]),
                    f"mixture names unknown dataset(s) {unknown}; datasets are {sorted(self.datasets)}"
                )
        return self

    @model_validator(mode="after")
    def _storage_options_fit(self) -> Config:
        # Checked here, not at the first request: s3fs and botocore fail there with a traceback
        # (one that may quote the options' values).
        urls = [self.lake, *(source for dataset in self.datasets.values() for source in dataset.sources)]
        if any(url.partition("://")[0].lower() in S3_PROTOCOLS for url in urls if "://" in url):
            problem = s3_options_problem(self.storage_options)
            if problem is not None:
                raise KeyValueError(("storage_options", *problem[0]), f"{problem[1]} (for s3:// URLs)")
        return self


def _is_url(path: str) -> bool:
    return "://" in path


def _resolve(path: str, base: Path) -> str:
    if _is_url(path) or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base.resolve(), path))


def resolve_paths(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """Make the lake, tokenizer and source paths of a raw config absolute against ``base``."""
    out = dict(raw)
    if isinstance(out.get("lake"), str):
        out["lake"] = _resolve(out["lake"], base)
    tokenizer = out.get("tokenizer")
    if isinstance(tokenizer, str) and (tokenizer.endswith(".json") or (base / tokenizer).exists()):
        out["tokenizer"] = _resolve(tokenizer, base)
    datasets = out.get("datasets")
    if isinstance(datasets, dict):
        out["datasets"] = {
            name: _resolve_sources(spec, base) if isinstance(spec, dict) else spec
            for name, spec in datasets.items()
        }
    return out


def _resolve_sources(spec: dict[str, Any], base: Path) -> dict[str, Any]:
    sources = spec.get("sources")
    if isinstance(sources, str):
        sources = [sources]
    if isinstance(sources, list):
        spec = {**spec, "sources": [_resolve(s, base) if isinstance(s, str) else s for s in sources]}
    return spec


def _key_lines(node: yaml.Node, prefix: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], int]:
    """1-based line of every key path in a composed YAML document."""
    lines = {prefix: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = (*prefix, key.value)
            lines.update(_key_lines(value, path))
            lines[path] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.update(_key_lines(item, (*prefix, i)))
    return lines


def _line_of(loc: tuple[Any, ...], lines: dict[tuple[Any, ...], int]) -> int | None:
    key = tuple(str(p) if not isinstance(p, int) else p for p in loc)
    while key:
        if key in lines:
            return lines[key]
        key = key[:-1]
    return None


def _error_loc(error: dict[str, Any]) -> tuple[Any, ...]:
    """Key path of a validation error, down to the key a :class:`KeyValueError` names."""
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    cause = (error.get("ctx") or {}).get("error")
    return (*loc, *cause.path) if isinstance(cause, KeyValueError) else loc


def _describe(error: dict[str, Any], loc: tuple[Any, ...]) -> str:
    key = ".".join(str(p) for p in loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key; remove it or check its spelling"
    if error["type"] == "missing":
        return f"{key}: required key is missing"
    message = error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    # Only a key's own scalar value is shown: a mapping's value may hold the whole config, and
    # storage_options hold credentials.
    if isinstance(value, (str, int, float, bool)) and "storage_options" not in loc:
        return f"{key} = {value!r}: {message}"
    return f"{key}: {message}"


def parse_config(raw: Any, *, source: str = "<config>", base: Path | None = None, text: str | None = None) -> Config:
    """Validate a raw mapping into a :class:`Config`; errors name ``source``, line and key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys (lake, tokenizer, datasets, ...)")
    raw = resolve_paths(raw, base or Path.cwd())
    try:
        return Config.model_validate({**raw, "source_file": source if source != "<config>" else None})
    except ValidationError as exc:
        lines = _key_lines(yaml.compose(text)) if text else {}
        problems = []
        for error in exc.errors():
            loc = _error_loc(error)
            line = _line_of(loc, lines)
            where = f"line {line}, " if line else ""
            problems.append(f"{where}{_describe(error, loc)}")
        if len(problems) == 1:   # the usual case: one line, as every error of the command line
            raise ConfigError(f"{source}: invalid config: {problems[0]}") from None
        raise ConfigError(f"{source}: invalid config:\n" + "\n".join(f"  {p}" for p in problems)) from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML syntax error as ``line L, column C: problem (context)``, without the quoted source
    text (the line may hold a credential)."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return str(exc)
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    context = ""
    if exc.context and exc.context_mark is not None:
        context = f" ({exc.context} at line {exc.context_mark.line + 1})"
    return f"{where}{exc.problem or exc.context or 'syntax error'}{context}"


def load_config(path: str | os.PathLike[str] | Config) -> Config:
    """Read and validate a YAML config file (a :class:`Config` passes through unchanged)."""
    if isinstance(path, Config):
        return path
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
    return parse_config(raw, source=str(path), base=path.parent, text=text)
