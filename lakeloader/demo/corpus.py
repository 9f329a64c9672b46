"""A small real-text demo corpus built from the running interpreter's standard library.

Every machine that runs lakeloader has a Python standard library, so the demo needs no
download: :func:`prepare_corpus` turns its sources, its help topics and its docstrings into
the datasets of ``configs/demo.yaml`` (JSON Lines, gzip and zstd JSON Lines, Parquet and
plain text). The output is deterministic: the same interpreter always gives the same bytes.

    python -m lakeloader.demo.corpus prepare demo/data [--size demo|bench]
"""

from __future__ import annotations

import argparse
import ast
import codecs
import gzip
import hashlib
import json
import logging
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

log = logging.getLogger("lakeloader.demo.corpus")

Size = Literal["demo", "bench"]

MANIFEST = "MANIFEST.json"
MANIFEST_VERSION = 1

# Folders of the standard library left out of the demo corpus (tests, IDLE, 2to3, packages).
DEMO_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"})
# pydoc_data/topics.py holds the help topics, which the docs dataset already carries as prose.
DEMO_EXCLUDED_TOP = frozenset({"pydoc_data"})
# Demo code: files up to this size (keeps a few documents longer than the tokenizer's 64K
# character pieces), at most this many bytes in all, taken in sorted order.
DEMO_MAX_FILE_BYTES = 96 * 1024
DEMO_CODE_BUDGET = 9 * 1024 * 1024
# Code shards: top-level modules grouped by first letter (leading underscores ignored).
# The last group is written zstd-compressed.
CODE_GROUPS = (("a", "c"), ("d", "e"), ("f", "o"), ("p", "s"), ("t", "z"))
DOCSTRING_ROW_GROUP_SIZE = 500
DOCSTRING_FILES = 2

BENCH_TEXT_BYTES = 110 * 1024 * 1024
BENCH_SHARD_BYTES = 16 * 1024 * 1024
BENCH_MAX_FILE_BYTES = 1024 * 1024
BENCH_EXCLUDED_DIRS = frozenset({"site-packages", "__pycache__"})

GZIP_LEVEL = 9
ZSTD_LEVEL = 10


@dataclass(frozen=True)
class SourceFile:
    """One ``.py`` file: its path relative to the corpus root and its UTF-8 text."""

    rel: str
    text: str


# ---------------------------------------------------------------------------- sources


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _py_paths(root: Path, excluded_dirs: frozenset[str]) -> list[tuple[str, Path]]:
    """``(relative posix path, path)`` of the ``.py`` files under ``root``, sorted by relative path."""
    found: list[tuple[str, Path]] = []
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in excluded_dirs]
        base = Path(folder)
        for name in filenames:
            if name.endswith(".py"):
                path = base / name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def _read_utf8(path: Path) -> str | None:
    """The file's text, or None when it is not valid UTF-8 or holds only whitespace."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() else None


def demo_code_files() -> list[SourceFile]:
    """The standard-library sources of the demo corpus, in sorted order, within the budget."""
    files: list[SourceFile] = []
    total = skipped = 0
    for rel, path in _py_paths(stdlib_root(), DEMO_EXCLUDED_DIRS):
        if rel.split("/", 1)[0] in DEMO_EXCLUDED_TOP or path.stat().st_size > DEMO_MAX_FILE_BYTES:
            continue
        text = _read_utf8(path)
        if text is None:
            skipped += 1
            continue
        size = len(text.encode("utf-8"))
        if total + size > DEMO_CODE_BUDGET:
            log.info("demo code budget of %d bytes reached at %s", DEMO_CODE_BUDGET, rel)
            break
        files.append(SourceFile(rel, text))
        total += size
    if skipped:
        log.info("skipped %d empty or non-UTF-8 standard-library files", skipped)
    return files


def _bench_sources() -> list[tuple[str, Path]]:
    """Roots of the bench corpus in order: the whole standard library, then site-packages."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", stdlib_root())]
    seen = {stdlib_root().resolve()}
    for key in ("purelib", "platlib"):
        root = Path(paths[key])
        if root.is_dir() and root.resolve() not in seen:
            seen.add(root.resolve())
            roots.append(("site-packages" if key == "purelib" else "platlib", root))
    stdlib_packages = stdlib_root() / "site-packages"
    if stdlib_packages.is_dir() and stdlib_packages.resolve() not in seen:
        roots.append(("stdlib-site-packages", stdlib_packages))
    return roots


def bench_code_files() -> Iterator[SourceFile]:
    """The bench corpus sources: stdlib (tests included), then site-packages, sorted per root."""
    for label, root in _bench_sources():
        for rel, path in _py_paths(root, BENCH_EXCLUDED_DIRS):
            try:
                if path.stat().st_size > BENCH_MAX_FILE_BYTES:
                    continue
            except OSError:
                continue
            text = _read_utf8(path)
            if text is not None:
                yield SourceFile(f"{label}/{rel}", text)


def _code_group(rel: str) -> int:
    """Index in :data:`CODE_GROUPS` of a file's top-level module."""
    top = rel.split("/", 1)[0].lstrip("_").lower() or "_"
    letter = top[0]
    for index, (first, last) in enumerate(CODE_GROUPS):
        if first <= letter <= last:
            return index
    return 0 if letter < CODE_GROUPS[0][0] else len(CODE_GROUPS) - 1


def help_topics() -> list[tuple[str, str]]:
    """``(topic, text)`` of pydoc's help topics, sorted by topic."""
    from pydoc_data.topics import topics

    return [(name, topics[name]) for name in sorted(topics) if topics[name].strip()]


def docstrings(files: Iterable[SourceFile]) -> Iterator[tuple[str, str]]:
    """``(text, source)`` of the module, class and function docstrings of ``files`` (via ``ast``).

    ``source`` is ``path`` for a module docstring and ``path:Qualified.name`` otherwise.
    """
    for file in files:
        try:
            tree = ast.parse(file.text, filename=file.rel)
        except (SyntaxError, ValueError):
            continue
        yield from _node_docstrings(tree, file.rel, "")


def _node_docstrings(node: ast.AST, rel: str, qualname: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        text = ast.get_docstring(node, clean=True)
        if text and text.strip():
            yield text, f"{rel}:{qualname}" if qualname else rel
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _node_docstrings(child, rel, f"{qualname}.{child.name}" if qualname else child.name)
        elif not isinstance(child, (ast.expr, ast.Lambda)):
            yield from _node_docstrings(child, rel, qualname)


def zen_of_python() -> str:
    """The Zen of Python, decoded from ``this.py``'s source (importing ``this`` prints it)."""
    path = stdlib_root() / "this.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return ""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "s" for t in node.targets)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return codecs.decode(node.value.value, "rot13")
    return ""


def _single_lines(text: str) -> list[str]:
    """The non-blank lines of ``text``, right-stripped, each free of any line separator."""
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def note_lines(docstring_texts: Iterable[str]) -> list[str]:
    """The notes dataset: Zen of Python, LICENSE.txt lines and docstrings' first lines (deduplicated)."""
    lines = _single_lines(zen_of_python())
    license_path = stdlib_root() / "LICENSE.txt"
    if license_path.is_file():
        lines += _single_lines(license_path.read_text(encoding="utf-8", errors="replace"))
    for text in docstring_texts:
        first = text.strip().splitlines()[0].strip()
        if first:
            lines.append(first)
    return list(dict.fromkeys(lines))


# ---------------------------------------------------------------------------- writing


def _jsonl(records: Iterable[dict[str, str]]) -> bytes:
    return b"".join(orjson.dumps(record) + b"\n" for record in records)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(
        table, sink, row_group_size=DOCSTRING_ROW_GROUP_SIZE, compression="zstd", compression_level=3,
        use_dictionary=False, write_statistics=True, version="2.6", data_page_version="1.0",
    )
    return sink.getvalue().to_pybytes()


class _Writer:
    """Writes files under ``out_dir`` and records them (dataset, docs, text bytes) for the manifest."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.files: dict[str, dict[str, object]] = {}

    def write(self, dataset: str, name: str, data: bytes, docs: int, text_bytes: int) -> None:
        rel = f"{dataset}/{name}"
        _write_atomic(self.out_dir / rel, data)
        self.record(dataset, rel, data, docs, text_bytes)

    def record(self, dataset: str, rel: str, data: bytes | Path, docs: int, text_bytes: int) -> None:
        if isinstance(data, Path):
            nbytes, digest = data.stat().st_size, _sha256_file(data)
        else:
            nbytes, digest = len(data), hashlib.sha256(data).hexdigest()
        self.files[rel] = {"dataset": dataset, "bytes": nbytes, "sha256": digest, "docs": docs,
                           "text_bytes": text_bytes}
        log.info("wrote %s: %d docs, %d text bytes, %d file bytes", rel, docs, text_bytes, nbytes)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_demo(writer: _Writer) -> None:
    files = demo_code_files()

    groups: list[list[SourceFile]] = [[] for _ in CODE_GROUPS]
    for file in files:
        groups[_code_group(file.rel)].append(file)
    for index, ((first, last), group) in enumerate(zip(CODE_GROUPS, groups)):
        if not group:
            continue
        data = _jsonl({"text": f.text, "path": f.rel} for f in group)
        text_bytes = sum(len(f.text.encode("utf-8")) for f in group)
        name = f"stdlib-{first}-{last}.jsonl"
        if index == len(CODE_GROUPS) - 1:
            data, name = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data), name + ".zst"
        writer.write("code", name, data, len(group), text_bytes)

    topics = help_topics()
    data = gzip.compress(_jsonl({"text": text, "topic": topic} for topic, text in topics),
                         compresslevel=GZIP_LEVEL, mtime=0)
    writer.write("docs", "topics.jsonl.gz", data, len(topics), sum(len(t.encode("utf-8")) for _, t in topics))

    per_file = -(-len(files) // DOCSTRING_FILES)
    all_docstrings: list[str] = []
    for index in range(DOCSTRING_FILES):
        rows = list(docstrings(files[index * per_file:(index + 1) * per_file]))
        texts = [text for text, _ in rows]
        all_docstrings += texts
        table = pa.table({"text": pa.array(texts, pa.string()),
                          "source": pa.array([source for _, source in rows], pa.string())})
        writer.write("docs", f"docstrings-{index:03d}.parquet", _parquet_bytes(table), len(rows),
                     sum(len(t.encode("utf-8")) for t in texts))

    lines = note_lines(all_docstrings)
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    writer.write("notes", "lines.txt", data, len(lines), len(data) - len(lines))


def _write_bench(writer: _Writer) -> None:
    """All stdlib sources, then site-packages, as ~16 MB JSON Lines shards until the target size."""
    total = docs = 0
    shard_index = 0
    buffer: list[bytes] = []
    shard_bytes = shard_docs = shard_text = 0

    def flush() -> None:
        nonlocal shard_index, buffer, shard_bytes, shard_docs, shard_text
        if buffer:
            writer.write("code", f"bench-{shard_index:03d}.jsonl", b"".join(buffer), shard_docs, shard_text)
            shard_index += 1
        buffer, shard_bytes, shard_docs, shard_text = [], 0, 0, 0

    passes = 0
    while total < BENCH_TEXT_BYTES:
        added = 0
        for file in bench_code_files():
            rel = file.rel if passes == 0 else f"{file.rel}#{passes + 1}"
            line = orjson.dumps({"text": file.text, "path": rel}) + b"\n"
            size = len(file.text.encode("utf-8"))
            buffer.append(line)
            shard_bytes += len(line)
            shard_docs += 1
            shard_text += size
            total += size
            docs += 1
            added += 1
            if shard_bytes >= BENCH_SHARD_BYTES:
                flush()
            if total >= BENCH_TEXT_BYTES:
                break
        if added == 0:
            break
        passes += 1
        if total < BENCH_TEXT_BYTES:
            log.warning("bench corpus: only %d text bytes of Python sources on this machine; repeating them", total)
    flush()
    log.info("bench corpus: %d docs, %d text bytes", docs, total)


# ---------------------------------------------------------------------------- manifest


def _identity(size: Size) -> dict[str, object]:
    return {"manifest_version": MANIFEST_VERSION, "size": size, "python": sys.version,
            "stdlib": str(stdlib_root())}


def _read_manifest(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _is_current(manifest: dict | None, out_dir: Path, size: Size) -> bool:
    if not manifest or any(manifest.get(k) != v for k, v in _identity(size).items()):
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for rel, info in files.items():
        path = out_dir / rel
        if not path.is_file() or path.stat().st_size != info.get("bytes"):
            return False
    return True


def _files_by_dataset(out_dir: Path, files: dict[str, dict]) -> dict[str, list[Path]]:
    result: dict[str, list[Path]] = {}
    for rel in sorted(files):
        result.setdefault(str(files[rel]["dataset"]), []).append(out_dir / rel)
    return dict(sorted(result.items()))


def prepare_corpus(out_dir: str | Path, size: Size = "demo") -> dict[str, list[Path]]:
    """Write the demo (or bench) corpus under ``out_dir``; return its files per dataset (sorted).

    Re-running is cheap: when ``out_dir/MANIFEST.json`` records the same size and interpreter
    and every listed file is present with its recorded size, nothing is written. Otherwise the
    files of a previous manifest are removed and the corpus is written again.
    """
    if size not in ("demo", "bench"):
        raise ValueError(f"size must be 'demo' or 'bench', not {size!r}")
    out = Path(out_dir)
    previous = _read_manifest(out)
    if _is_current(previous, out, size):
        log.info("%s corpus in %s is up to date (%s)", size, out, MANIFEST)
        return _files_by_dataset(out, previous["files"])  # type: ignore[index]
    if previous and isinstance(previous.get("files"), dict):
        for rel in previous["files"]:
            (out / rel).unlink(missing_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    writer = _Writer(out)
    if size == "demo":
        _write_demo(writer)
    else:
        _write_bench(writer)

    datasets: dict[str, dict[str, int]] = {}
    for info in writer.files.values():
        stats = datasets.setdefault(str(info["dataset"]), {"files": 0, "docs": 0, "text_bytes": 0, "bytes": 0})
        stats["files"] += 1
        for key in ("docs", "text_bytes", "bytes"):
            stats[key] += int(info[key])  # type: ignore[call-overload]
    manifest = {**_identity(size), "datasets": datasets, "files": writer.files}
    _write_atomic(out / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return _files_by_dataset(out, writer.files)


def corpus_stats(out_dir: str | Path) -> dict[str, dict[str, int]]:
    """Per-dataset ``files``, ``docs``, ``text_bytes`` and ``bytes`` recorded in ``out_dir``'s manifest."""
    manifest = _read_manifest(Path(out_dir))
    return dict(manifest.get("datasets", {})) if manifest else {}


# ---------------------------------------------------------------------------- reading


def iter_texts(paths: Iterable[str | Path]) -> Iterator[str]:
    """The document texts of corpus files (``.jsonl[.gz|.zst]``, ``.parquet``, ``.txt``)."""
    for path in map(Path, paths):
        name = path.name
        if name.endswith(".parquet"):
            parquet = pq.ParquetFile(path)
            for index in range(parquet.num_row_groups):
                yield from parquet.read_row_group(index, columns=["text"]).column(0).to_pylist()
        elif name.endswith(".txt"):
            yield from path.read_text(encoding="utf-8").split("\n")[:-1]
        elif ".jsonl" in name:
            data = path.read_bytes()
            if name.endswith(".gz"):
                data = gzip.decompress(data)
            elif name.endswith(".zst"):
                data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
            for line in data.splitlines():
                yield orjson.loads(line)["text"]
        else:
            raise ValueError(f"{path}: not a corpus file")


# ---------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lakeloader.demo.corpus prepare OUT_DIR [--size demo|bench]``."""
    parser = argparse.ArgumentParser(prog="python -m lakeloader.demo.corpus",
                                     description="Prepare the demo corpus from the Python standard library.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    prepare = commands.add_parser("prepare", help="write the corpus (skipped when already up to date)")
    prepare.add_argument("out_dir", metavar="OUT_DIR")
    prepare.add_argument("--size", choices=("demo", "bench"), default="demo")
    prepare.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prepare_corpus(args.out_dir, args.size)
    stats = corpus_stats(args.out_dir)
    summary = ", ".join(f"{name} {s['docs']:,} docs / {s['text_bytes'] / 1e6:.1f} MB in {s['files']} files"
                        for name, s in sorted(stats.items()))
    print(f"{args.size} corpus in {args.out_dir}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
