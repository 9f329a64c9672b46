"""How the records of each dataset format become documents: lists of parts (kind, text, reference).

Parts hold only the record's own text; templates and special tokens are added at collation.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple


class Part(NamedTuple):
    """One part of a document: its kind (index into the format's kind names), text and reference.

    An image part of an interleaved dataset with ``images: stored`` holds, as read, the image's
    bytes or a path/URL (str) to read them from; the build replaces it with the image's id."""

    kind: int
    text: str
    ref: str | bytes | None = None


# A document's parts. A tuple, not a list: tuples of strings and ints leave the garbage
# collector's tracking, so millions of them in a split cost its passes nothing.
Document = tuple[Part, ...]


class RecordError(ValueError):
    """A record that does not fit its format; str() is the reason."""


# Integers a metadata field can hold (stored as int64). A float field takes ints.
_INT64 = (-(2**63), 2**63)

_new_part = tuple.__new__   # Part(kind, text, ref) without the keyword-handling constructor
_COLUMN_FIELDS = {"text": ("text_field",), "fim": ("text_field",), "infill": ("text_field",),
                  "chat": ("messages_field",), "supervised": ("prompt_field", "response_field"),
                  "interleaved": ("items_field",)}


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _keys(mapping: Iterable[Any]) -> str:
    return ", ".join(sorted(map(str, mapping))[:10]) or "none"


def _string(value: Any, what: str, expected: str = "a string") -> str:
    if isinstance(value, str):
        return value
    if value is None:
        raise RecordError(f"{what} is null, expected {expected}")
    raise RecordError(f"{what} is {type(value).__name__}, expected {expected}")


@dataclasses.dataclass(frozen=True)
class RecordFormat:
    """How records of one dataset become parts (picklable: it travels to Dask workers)."""

    format: str
    fields: tuple[tuple[str, Any], ...]   # sorted items of the dataset's build fields; lists -> tuples
    kind_names: tuple[str, ...]           # the dataset's part kinds: a part's kind is its index
    metadata: tuple[tuple[str, str], ...] = ()   # (field, type fixed at planning) kept with each document

    @functools.cached_property
    def _options(self) -> dict[str, Any]:
        return dict(self.fields)

    @functools.cached_property
    def _parser(self) -> Callable[[RecordFormat, dict[str, Any]], Document]:
        return _PARSERS[self.format]

    @functools.cached_property
    def _role_kinds(self) -> dict[str, int]:
        return {role: kind for kind, role in enumerate(self._options.get("roles", ()))}

    @property
    def columns(self) -> tuple[str, ...]:
        """The top-level record fields (Parquet columns) the build reads."""
        return tuple(self._options[key] for key in _COLUMN_FIELDS[self.format])

    @property
    def text_only(self) -> bool:
        """Whether documents are one string (text, fim and infill; plain .txt sources allowed)."""
        return self.format in ("text", "fim", "infill")

    @property
    def stores_images(self) -> bool:
        """Whether the build reads, checks and stores the images (``interleaved.images: stored``)."""
        return self._options.get("images") == "stored"

    @property
    def max_pixels(self) -> int:
        """``interleaved.max_pixels`` of a dataset that stores its images."""
        return int(self._options["max_pixels"])

    def config_key(self, field: str) -> str:
        """The config key that names build field ``field`` (e.g. ``chat.messages_field``)."""
        return field if self.text_only else f"{self.format}.{field}"

    def missing_columns(self, names: Iterable[str]) -> str | None:
        """Why a table with columns ``names`` cannot be read (None when it has every column)."""
        names = list(names)
        for key in _COLUMN_FIELDS[self.format]:
            if self._options[key] not in names:
                return (f"no column {self._options[key]!r} (columns: {', '.join(names)}); "
                        f"set {self.config_key(key)}")
        return None

    def parts(self, record: dict[str, Any]) -> Document:
        """The parts of one record (a JSON object or Parquet row); RecordError if it does not fit."""
        return self._parser(self, record)

    def metadata_values(self, record: dict[str, Any]) -> tuple[Any, ...]:
        """The values of the metadata fields of one JSON record (a missing field is None);
        RecordError for a value of another type than its field's."""
        return tuple(_metadata_value(record.get(name), name, kind) for name, kind in self.metadata)

    def text_parts(self, text: str) -> Document:
        """A plain string (a line of a .txt source) as a document of a text-only format."""
        return (_new_part(Part, (0, text, None)),)

    def _field(self, record: dict[str, Any], key: str) -> Any:
        name = self._options[key]
        try:
            return record[name]
        except KeyError:
            raise RecordError(f"no field {name!r} (fields: {_keys(record)}); set {self.config_key(key)}") from None


def metadata_kind(value: Any) -> str | None:
    """The metadata field type of a parsed JSON value: "bool" (checked before "int": bool is a
    subclass of int), "int", "float" or "string"; None for null, objects and lists."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    return None


def _metadata_value(value: Any, name: str, kind: str) -> Any:
    if value is None:
        return None
    found = metadata_kind(value)
    if found is None:
        raise RecordError(f"metadata field {name!r} is {_type(value)} ({_kind_name(value)}), expected {kind} "
                          "or null: metadata holds strings, numbers, booleans and nulls")
    if found == "int" and not _INT64[0] <= value < _INT64[1]:
        raise RecordError(f"metadata field {name!r} is {value}, beyond the 64-bit integers it is stored as")
    if found == kind or (found == "int" and kind == "float"):
        return value
    raise RecordError(f"metadata field {name!r} is {found} ({value!r}), expected {kind} (the field's type, "
                      "as given in metadata_fields or taken from its first value)")


def _kind_name(value: Any) -> str:
    return "an object" if isinstance(value, dict) else "a list" if isinstance(value, list) else "not a scalar"


def _text(fmt: RecordFormat, record: dict[str, Any]) -> Document:
    name = fmt._options["text_field"]
    text = record.get(name)
    if text.__class__ is str and text:  # the hot path: one check for a good document
        return (_new_part(Part, (0, text, None)),)
    text = _string(fmt._field(record, "text_field"), f"field {name!r}")
    if not text:
        raise RecordError(f"empty document (field {name!r} is empty)")
    return (Part(0, text),)


def _list(fmt: RecordFormat, record: dict[str, Any], key: str, noun: str) -> list[Any]:
    name = fmt._options[key]
    values = fmt._field(record, key)
    if not isinstance(values, list):
        raise RecordError(f"field {name!r} is {_type(values)}, expected a list of {noun}")
    if not values:
        raise RecordError(f"no {noun}")
    return values


def _chat(fmt: RecordFormat, record: dict[str, Any]) -> Document:
    options = fmt._options
    name, role_key, content_key = options["messages_field"], options["role_key"], options["content_key"]
    kinds = fmt._role_kinds
    parts = []
    for i, message in enumerate(_list(fmt, record, "messages_field", "messages")):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise RecordError(f"{where} is {_type(message)}, expected an object with {role_key!r} and {content_key!r}")
        for key, config in ((role_key, "role_key"), (content_key, "content_key")):
            if key not in message:
                raise RecordError(f"{where} has no {key!r} (keys: {_keys(message)}); set {fmt.config_key(config)}")
        role = message[role_key]
        kind = kinds.get(role) if isinstance(role, str) else None
        if kind is None:
            raise RecordError(f"{where} has role {role!r}, not one of {list(options['roles'])}; add it to chat.roles")
        parts.append(Part(kind, _string(message[content_key], f"{where}.{content_key}")))
    if not any(part.text for part in parts):
        raise RecordError(f"empty document (every {content_key!r} in {name!r} is empty)")
    return tuple(parts)


def _supervised(fmt: RecordFormat, record: dict[str, Any]) -> Document:
    parts = []
    for kind, key in enumerate(("prompt_field", "response_field")):
        name = fmt._options[key]
        parts.append(Part(kind, _string(fmt._field(record, key), f"field {name!r}")))
    if not (parts[0].text or parts[1].text):
        prompt, response = fmt.columns
        raise RecordError(f"empty document (fields {prompt!r} and {response!r} are empty)")
    return tuple(parts)


def _interleaved(fmt: RecordFormat, record: dict[str, Any]) -> Document:
    options = fmt._options
    name, text_key, image_key = options["items_field"], options["text_key"], options["image_key"]
    parts = []
    for i, item in enumerate(_list(fmt, record, "items_field", "items")):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise RecordError(f"{where} is {_type(item)}, expected an object with {text_key!r} or {image_key!r}")
        # A null value counts as absent: Parquet structs always hold both keys.
        text, image = item.get(text_key), item.get(image_key)
        if text is None and image is None:
            raise RecordError(f"{where} has neither {text_key!r} nor {image_key!r}")
        if text is not None and image is not None:
            raise RecordError(f"{where} has both {text_key!r} and {image_key!r}; give one per item")
        if image is None:
            parts.append(Part(0, _string(text, f"{where}.{text_key}")))
            continue
        if options.get("images") == "stored":
            parts.append(Part(1, "", _stored_image(image, f"{where}.{image_key}")))
            continue
        ref = _string(image, f"{where}.{image_key}", "a URI or id string")
        if not ref:
            raise RecordError(f"{where}.{image_key} is empty, expected a URI or id string")
        parts.append(Part(1, "", ref))
    if not any(part.text or part.kind == 1 for part in parts):
        raise RecordError(f"empty document (every {text_key!r} in {name!r} is empty and there is no {image_key!r})")
    return tuple(parts)


def _stored_image(value: Any, where: str) -> str | bytes:
    """An image item's value under ``images: stored``: its bytes (binary, a ``{bytes, path}``
    struct as Hugging Face datasets write them, or ``{"bytes": base64}`` in JSON), else the path or
    URL it names."""
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if isinstance(data, str):   # JSON has no bytes: base64 text
            try:
                data = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise RecordError(f"{where}.bytes is not base64 (JSON holds an image's bytes as base64 text)"
                                  ) from None
        if data:
            return bytes(data)
        if data is not None and not data:
            raise RecordError(f"{where}.bytes is empty")
        value = path
    if isinstance(value, (bytes, bytearray)):
        if not value:
            raise RecordError(f"{where} is empty bytes, expected an image")
        return bytes(value)
    path = _string(value, where, "image bytes, a {bytes, path} object or a path/URL string")
    if not path:
        raise RecordError(f"{where} is empty, expected image bytes or a path/URL")
    return path


_PARSERS: dict[str, Callable[[RecordFormat, dict[str, Any]], Document]] = {
    "text": _text, "fim": _text, "infill": _text, "chat": _chat, "supervised": _supervised, "interleaved": _interleaved,
}
