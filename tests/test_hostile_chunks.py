"""A shared lake is untrusted input (issue 47 items 5, 6): a chunk file damaged where no page
CRC-32 reaches (its footer, a page header) gives the intact answer or one clear error naming the
chunk, from the documents view and from the loader with ``verify: size``: never a crash of the
process, never wrong values. Flips that could crash run in a child process, which is restarted
after each crash, each flip under a time limit."""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.parquet as pq
import pytest

import lakeloader.catalog.hash_records as hashed_module
from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.snapshot import publish_snapshot
from lakeloader.catalog.store import CatalogWriter
from lakeloader.contracts.errors import ChunkIntegrityError
from lakeloader.feed.loader import Loader

from conftest import Lakes, stdlib_texts
from test_page_checksums import copy_lake

SEQ_LEN = 32
BATCH = 4
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"   # where a page's compressed data starts (its header ends)
PER_FLIP_S = 20.0                   # a flip's read taking longer counts as a hang
CHILD_MEMORY = 4 << 30              # a damaged size must not make a child take the machine's memory


@pytest.fixture(scope="module")
def lake_root(lakes: Lakes) -> Path:
    """A built lake of one dataset ``d`` with metadata (a float and a string) in chunks of a few
    row groups each (never modified)."""
    texts = [p for text in stdlib_texts("json") for p in text.split("\n\n") if p.strip()]
    lines = "".join(json.dumps({"text": t, "score": i / 10, "lang": ("en", "fr")[i % 2]}) + "\n"
                    for i, t in enumerate(texts))
    return lakes.shared({"d.jsonl": lines}, {"d": {"sources": ["d.jsonl"], "metadata_fields":
                                                  {"score": "float", "lang": "string"}}},
                        build={"split_size": "16KB", "row_group_tokens": 400}).parent


def last_chunk(config: Path) -> int:
    """The dataset's last chunk (its fewest row groups: the quickest to read for each flip)."""
    return int(open_lake(config).sql("SELECT max(global_index) AS i FROM chunks").i[0])


def steps_of(loader: Loader, index: int) -> range:
    """The steps whose batches hold tokens of chunk ``index`` (concat packing, no shuffling: rows
    are the token stream, one EOS after each document, cut every SEQ_LEN tokens)."""
    chunks = loader.view.dataset("d")
    lengths = chunks.num_tokens + chunks.num_docs
    start, stop = int(lengths[:index].sum()), int(lengths[:index + 1].sum())
    return range(start // SEQ_LEN // BATCH, (stop - 1) // SEQ_LEN // BATCH + 1)


def hash_spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The chunk files hashed from now on, each time one is."""
    hashed: list[str] = []
    real = hashed_module.sha256_of

    def spy(handle: Any) -> str:
        name = os.readlink(f"/proc/self/fd/{handle.fileno()}")
        if name.endswith(".parquet"):   # chunk files, not the catalog's
            hashed.append(name)
        return real(handle)

    monkeypatch.setattr(hashed_module, "sha256_of", spy)
    return hashed


def chunk_file(config: Path, index: int) -> Path:
    lake = open_lake(config)
    found = lake.sql(f"SELECT path FROM chunks WHERE dataset = 'd' AND global_index = {index}")
    return Path(lake.path_of(found.path[0]))


# -- where the footer keeps what: a reader of Thrift's compact protocol of the tests' own -------------

def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _walk(data: bytes, pos: int, kind: int, path: tuple[int, ...], out: dict[tuple[int, ...], range]) -> int:
    """Where the value of Thrift type ``kind`` at ``data[pos]`` ends; the byte range of every
    value under it recorded in ``out`` by its path of field ids and list positions."""
    start = pos
    if kind in (1, 2):                      # a struct field's boolean: in its header, no bytes
        pass
    elif kind == 3:
        pos += 1
    elif kind in (4, 5, 6):
        pos = _varint(data, pos)[1]
    elif kind == 7:
        pos += 8
    elif kind == 8:
        size, pos = _varint(data, pos)
        pos += size
    elif kind in (9, 10):
        head = data[pos]
        pos += 1
        count = head >> 4
        if count == 15:
            count, pos = _varint(data, pos)
        for i in range(count):
            pos = pos + 1 if head & 0x0F in (1, 2) else _walk(data, pos, head & 0x0F, (*path, i), out)
    elif kind == 12:
        field = 0
        while data[pos]:
            head = data[pos]
            pos += 1
            if head >> 4:
                field += head >> 4
            else:
                number, pos = _varint(data, pos)
                field = (number >> 1) ^ -(number & 1)
            pos = _walk(data, pos, head & 0x0F, (*path, field), out)
        pos += 1
    else:
        raise ValueError(kind)
    out[path] = range(start, pos)
    return pos


def footer_fields(path: Path) -> tuple[range, dict[tuple[int, ...], range]]:
    """The footer's byte range in the file, and each of its values' (by field path, in the file)."""
    data = path.read_bytes()
    length = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - length
    found: dict[tuple[int, ...], range] = {}
    _walk(data, start, 12, (), found)
    return range(start, len(data) - 8), found


def schema_element(path: Path, name: str) -> int:
    """The position in FileMetaData.schema of the first element named ``name``."""
    data = path.read_bytes()
    names = sorted((key[1], bytes(data[where.start:where.stop])) for key, where in footer_fields(path)[1].items()
                   if len(key) == 3 and key[0] == 2 and key[2] == 4)   # SchemaElement.name (its length first)
    for element, stored in names:
        if stored.endswith(name.encode()):
            return element
    raise AssertionError(f"no schema element {name}")


def all_bits(where: range) -> list[tuple[int, int]]:
    return [(offset, bit) for offset in where for bit in range(8)]


def token_page_headers(path: Path, group: int, column: int = 1) -> range:
    """The bytes of the page header of row group ``group``'s tokens (or another leaf ``column``:
    one page per column chunk here)."""
    data = path.read_bytes()
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(column)
    assert column != 1 or chunk.path_in_schema == "tokens.list.element"
    return range(chunk.data_page_offset, data.index(ZSTD_MAGIC, chunk.data_page_offset))


# -- flips read in a child process ---------------------------------------------------------------------

_CHILD = r"""
import json, os, sys
from pathlib import Path
from lakeloader.catalog.lake import open_lake
from lakeloader.contracts.errors import ChunkIntegrityError

config, index, action, positions = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
lake = open_lake(config)
if action == "chunks":
    from lakeloader.read.catalog_view import CatalogView
    from lakeloader.read.chunks import ChunkFiles
    chunks = CatalogView(lake).dataset("d")
    path = Path(lake.path_of(chunks.record(index).path))
else:
    path = Path(lake.path_of(lake.sql(f"SELECT path FROM chunks WHERE global_index = {index}").path[0]))
pristine = path.read_bytes()

def read():
    if action == "documents":
        return lake.sql("SELECT chunk, doc, line, num_tokens, score, lang FROM documents ORDER BY chunk, doc").to_json()
    files = ChunkFiles(lake, "size", 2**30, 0)
    found = [files.chunk_parts(chunks, index).part_lengths.tolist()]
    for group in range(int(os.environ["GROUPS"])):
        row_group = files.read_row_group(chunks, index, group)
        found.append([row_group.values.tolist(), str(row_group.values.dtype), row_group.parts.part_lengths.tolist(),
                      row_group.parts.part_kinds.tolist()])
    return json.dumps(found)

intact = read()
print(json.dumps({"ready": True}), flush=True)
for line in open(positions):
    offset, bit = map(int, line.split())
    damaged = bytearray(pristine)
    damaged[offset] ^= 1 << bit
    path.write_bytes(bytes(damaged))
    try:
        outcome = {"outcome": "same" if read() == intact else "WRONG"}
    except ChunkIntegrityError as exc:
        outcome = {"outcome": "error", "message": str(exc)}
    except Exception as exc:
        outcome = {"outcome": "other", "message": f"{type(exc).__name__}: {exc}"}
    path.write_bytes(pristine)
    print(json.dumps({"at": [offset, bit], **outcome}), flush=True)
"""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def flip_outcomes(config: Path, index: int, action: str, positions: list[tuple[int, int]],
                  work: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """Each (byte, bit) of chunk ``index``'s file flipped alone, what ``action`` ("documents": a
    query of the documents view; "chunks": every row group and the part layout of the chunk read
    with ``verify: size``) made of it: "same" as the intact file, "error" (a ChunkIntegrityError,
    with its message), "WRONG" (other values), "other" (another exception), "crash" (the process
    died) or "hang"."""
    path = chunk_file(config, index)
    pristine = path.read_bytes()
    groups = pq.ParquetFile(path).metadata.num_row_groups
    found: dict[tuple[int, int], dict[str, Any]] = {}
    todo = dict.fromkeys(positions)   # in order, each once
    try:
        while todo:
            listed = work / "positions.txt"
            listed.write_text("".join(f"{offset} {bit}\n" for offset, bit in todo))
            errors = open(work / "stderr.txt", "w+")
            child = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(config), str(index), action, str(listed)],
                stdout=subprocess.PIPE, stderr=errors, text=True, preexec_fn=_limit_memory,
                env={**os.environ, "GROUPS": str(groups)})
            ready = hung = False
            assert child.stdout is not None
            while True:
                if not select.select([child.stdout], [], [], PER_FLIP_S if ready else 120)[0]:
                    hung = True
                    child.kill()
                    break
                line = child.stdout.readline()
                if not line:
                    break
                answer = json.loads(line)
                if answer.pop("ready", False):
                    ready = True
                    continue
                at = tuple(answer.pop("at"))
                found[at] = answer
                del todo[at]
            child.stdout.close()
            child.wait()
            path.write_bytes(pristine)
            errors.seek(0)
            if todo:
                assert ready, f"the child failed on the intact lake: {errors.read()}"
                at = next(iter(todo))   # the flip the child was reading
                del todo[at]
                found[at] = {"outcome": "hang" if hung else "crash",
                             "message": f"exit {child.returncode}: {errors.read()[-500:]}"}
            errors.close()
    finally:
        path.write_bytes(pristine)
    return found


def assert_intact_or_named(found: dict[tuple[int, int], dict[str, Any]], index: int, path: Path) -> int:
    """Every flip gave the intact answer or one ChunkIntegrityError naming chunk ``index`` of
    dataset d, its file and what to do; the number of errors."""
    bad = {at: answer for at, answer in found.items() if answer["outcome"] not in ("same", "error")}
    assert not bad, f"{len(bad)} of {len(found)} flips: " + "; ".join(
        f"bit {bit} of byte {offset}: {answer['outcome']} {answer.get('message', '')[:300]}"
        for (offset, bit), answer in list(bad.items())[:10])
    errors = [answer["message"] for answer in found.values() if answer["outcome"] == "error"]
    for message in errors:
        assert f"chunk {index} of dataset 'd' ({path})" in message, message
        assert "lakeloader verify CONFIG --repair" in message and "\n" not in message, message
    return len(errors)


# -- the documents view ---------------------------------------------------------------------------------

def without_documents_index(config: Path) -> None:
    """The lake of ``config`` as one built before the documents index: the documents view reads
    its chunk files (what these tests damage)."""
    lake = open_lake(config)
    with CatalogWriter(lake.writer_catalog_path) as writer:
        writer.con.execute("DELETE FROM document_index_chunks; DELETE FROM document_index_files")
        publish_snapshot(writer.con, lake, None)


def test_documents_view_checks_each_chunk_against_its_record(lake_root: Path, tmp_path: Path) -> None:
    """The issue's case: a bit of the footer flipped where a metadata column's physical type is
    (meta.score DOUBLE read as INT32 or INT64 gave -1.7e9 for 0.1), and a sample of every other
    footer byte: the documents view gives the intact rows or an error naming the chunk, as the
    loader checks it (size and sha256)."""
    config = copy_lake(lake_root, tmp_path)
    without_documents_index(config)
    index = last_chunk(config)
    path = chunk_file(config, index)
    footer, fields = footer_fields(path)
    score = schema_element(path, "meta.score")
    positions = all_bits(fields[(2, score, 1)])             # SchemaElement.type of meta.score
    positions += [(offset, offset % 8) for offset in footer[::13]]
    found = flip_outcomes(config, index, "documents", positions, tmp_path)
    assert assert_intact_or_named(found, index, path) > len(positions) // 3
    assert found[(fields[(2, score, 1)].start, 3)]["outcome"] == "error"   # DOUBLE (5) as INT32 (1)


def test_documents_view_names_a_missing_or_altered_chunk(lake_root: Path, tmp_path: Path) -> None:
    """In one process: a chunk altered anywhere (here in a page's data, same size) or gone is an
    error naming it and what to do, for any query of the view (its files are checked before the
    query runs, whatever its filter); the intact file answers again."""
    config = copy_lake(lake_root, tmp_path)
    without_documents_index(config)
    lake = open_lake(config)
    query = "SELECT chunk, count(*) AS docs, round(sum(score), 6) AS score FROM documents GROUP BY chunk ORDER BY chunk"
    intact = lake.sql(query)
    path = chunk_file(config, 2)
    pristine = path.read_bytes()
    damaged = bytearray(pristine)
    damaged[len(damaged) // 2] ^= 0x10
    path.write_bytes(bytes(damaged))
    with pytest.raises(ChunkIntegrityError, match=r"chunk 2 of dataset 'd' \(.*\) is corrupt: it has sha256 .*, the "
                                                  r"catalog says .*lakeloader verify CONFIG --repair"):
        lake.sql(query)
    with pytest.raises(ChunkIntegrityError, match=r"chunk 2 of dataset 'd' \(.*\) is corrupt"):
        lake.sql("SELECT count(*) AS n FROM documents WHERE chunk <> 2")
    path.unlink()
    with pytest.raises(ChunkIntegrityError, match=r"chunk 2 of dataset 'd' \(.*\) is missing.*lakeloader build CONFIG"):
        lake.stats()
    path.write_bytes(pristine)
    assert lake.sql(query).equals(intact)


def test_documents_view_hashes_a_local_file_once_per_machine(lake_root: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A local lake's chunk files hashed by one query are not hashed again by the next while
    unchanged (the loader's records of hashed files); one changed is hashed again."""
    monkeypatch.setattr(hashed_module, "RACY_SECONDS", 0.0)   # the copy was just written
    hashed = hash_spy(monkeypatch)
    config = copy_lake(lake_root, tmp_path)
    without_documents_index(config)
    lake = open_lake(config)
    chunks = int(lake.sql("SELECT count(*) AS n FROM chunks").n[0])
    first = lake.sql("SELECT sum(num_tokens) AS n FROM documents")
    assert len(hashed) == chunks >= 3
    hashed.clear()
    assert lake.sql("SELECT sum(num_tokens) AS n FROM documents").equals(first)
    assert hashed == []
    path = chunk_file(config, 0)
    path.write_bytes(path.read_bytes())   # the same bytes, written again: another change time
    assert lake.sql("SELECT sum(num_tokens) AS n FROM documents").equals(first)
    assert hashed == [str(path)]


def test_documents_view_of_a_remote_lake_hashes_what_it_reads(lake_root: Path, tmp_path: Path) -> None:
    """A remote lake (here fsspec's memory filesystem): each chunk file is downloaded whole, checked
    against its record and read from those bytes; a damaged one is an error naming it."""
    config = copy_lake(lake_root, tmp_path)
    memory = fsspec.filesystem("memory")
    root = tmp_path / "lake"
    for file in root.rglob("*"):
        if file.is_file():
            memory.pipe_file(f"/hostile-chunks/lake/{file.relative_to(root)}", file.read_bytes())
    try:
        intact = open_lake(config).sql("SELECT chunk, doc, score, lang FROM documents ORDER BY chunk, doc")
        remote = open_lake("memory://hostile-chunks/lake")
        assert not remote.is_local
        # From the documents index (its files downloaded and hashed alike), then from the chunk files.
        assert remote.sql("SELECT chunk, doc, score, lang FROM documents ORDER BY chunk, doc").equals(intact)
        without_documents_index(config)
        for file in (root / "_catalog").rglob("*"):
            if file.is_file():
                memory.pipe_file(f"/hostile-chunks/lake/{file.relative_to(root)}", file.read_bytes())
        assert remote.sql("SELECT chunk, doc, score, lang FROM documents ORDER BY chunk, doc").equals(intact)
        relative = chunk_file(config, 1).relative_to(root)
        name = f"/hostile-chunks/lake/{relative}"
        damaged = bytearray(memory.cat_file(name))
        damaged[-200] ^= 0x04   # in the footer
        memory.pipe_file(name, bytes(damaged))
        with pytest.raises(ChunkIntegrityError, match=rf"chunk 1 of dataset 'd' \(memory://.*{relative.name}\) is "
                                                      "corrupt: it has sha256"):
            remote.sql("SELECT sum(score) FROM documents")
    finally:
        memory.rm("/hostile-chunks", recursive=True)


# -- the loader with verify: size ------------------------------------------------------------------------

def test_footer_flips_never_crash_the_loader_nor_change_what_it_reads(lake_root: Path, tmp_path: Path) -> None:
    """``verify: size`` checks no hash up front: every bit of what tells where row group 0's
    tokens are and how they are stored (its rows, the column chunk's type, codec, values, size and
    offset: a damaged codec made pyarrow's metadata objects abort the process), the tokens' schema
    element, and one bit of every other footer byte: the chunk's row groups and part layout read
    as intact or raise one error naming the chunk."""
    config = copy_lake(lake_root, tmp_path, verify="size")
    index = last_chunk(config)
    path = chunk_file(config, index)
    assert pq.ParquetFile(path).metadata.num_row_groups >= 2
    footer, fields = footer_fields(path)
    tokens = 1   # the tokens column's leaf (record is column 0)
    positions = all_bits(fields[(4, 0, 3)])   # RowGroup.num_rows
    for field in (1, 4, 5, 7, 9):             # ColumnMetaData type, codec, num_values, size, offset
        positions += all_bits(fields[(4, 0, 1, tokens, 3, field)])
    element = schema_element(path, "element")  # the first leaf named element: the tokens'
    positions += all_bits(fields[(2, element, 1)])
    positions += [(offset, offset % 8) for offset in footer]
    found = flip_outcomes(config, index, "chunks", positions, tmp_path)
    assert assert_intact_or_named(found, index, path) > len(positions) // 3


def test_page_header_flips_never_change_what_the_loader_reads(lake_root: Path, tmp_path: Path) -> None:
    """Every bit of the page headers (which their CRC-32s do not cover: sizes and value counts; a
    flip once read 23,506 of 89,626 tokens) of a chunk's tokens, part lengths and part kinds, in
    every row group: the intact tokens and layout or an error naming the chunk."""
    config = copy_lake(lake_root, tmp_path, verify="size")
    index = last_chunk(config)
    path = chunk_file(config, index)
    groups = pq.ParquetFile(path).metadata.num_row_groups
    positions = [at for group in range(groups) for column in (1, 2, 3)   # tokens, part_lengths, part_kinds
                 for at in all_bits(token_page_headers(path, group, column))]
    found = flip_outcomes(config, index, "chunks", positions, tmp_path)
    assert assert_intact_or_named(found, index, path) > len(positions) // 2


def test_loader_with_verify_size_names_a_chunk_with_a_damaged_page_header(
        lake_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the Loader: intact chunk files are read without hashing any (``verify: size`` stays
    what it was); a token page header whose page type is damaged (pyarrow then skipped the page:
    fewer tokens than stored, and a numpy ValueError) fails the batches reading the chunk with one
    error naming it, while the other batches are the intact lake's."""
    hashed = hash_spy(monkeypatch)
    config = copy_lake(lake_root, tmp_path, verify="size")
    intact = Loader(config)
    chunks = intact.view.dataset("d")
    index = 1
    steps = steps_of(intact, index)
    others = [steps.start - 2, steps.start - 1]
    expected = {s: intact.batch(s) for s in others}
    for step in range(steps_of(intact, chunks.committed - 1).stop):
        intact.batch(step)
    for chunk in range(chunks.committed):
        intact.files.chunk_parts(chunks, chunk)
    assert len(intact.files.files_opened) == chunks.committed >= 3
    assert hashed == []
    intact.close()
    path = chunk_file(config, index)
    header = token_page_headers(path, 0)
    data = bytearray(path.read_bytes())
    data[header.start + 1] ^= 0x01   # PageHeader.type (after its field's header): 0 (a data page) made -1
    path.write_bytes(bytes(data))
    loader = Loader(config)
    for step in others:
        assert all((loader.batch(step)[k] == v).all() for k, v in expected[step].items())
    with pytest.raises(ChunkIntegrityError, match=rf"chunk {index} of dataset 'd' \({path}\) is corrupt"):
        for step in steps:
            loader.batch(step)
    assert hashed == [str(path)]   # what the size cannot prove, the hash did
    loader.close()
