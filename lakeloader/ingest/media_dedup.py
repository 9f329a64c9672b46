"""Each image stored once per dataset: at a build's end, the media file of every chunk holding
images that a lower chunk of its dataset holds too is rewritten without them.

Chunk tasks run in parallel and each writes its chunk's distinct images (``ingest/chunk.py``), so
an image used in several chunks is first stored in each. Its **home** is the media file of the
lowest chunk (global index) holding it: a function of the committed chunks alone, whatever the
tasks' timing. Once every chunk is committed, the driver rewrites each other chunk's media file
keeping only the images it is the home of, its footer naming the home of each other (the media
file holding it now; :func:`~lakeloader.ingest.media.keep_images`: the same bytes however often it
is rewritten), named by its content beside the chunk
(``contracts/media.py`` ``deduped_media_path``) and recorded in ``media_files`` with its size and
sha256. The file it replaces stays in the lake for readers of older snapshots until ``lakeloader
gc``. A chunk added later (a grown plan appends chunks after the built ones) is rewritten by the
build that commits it; a re-plan forgets the rewrites (the chunks' indices change).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.store import CatalogWriter, MediaFile
from lakeloader.contracts.errors import ChunkIntegrityError
from lakeloader.contracts.media import deduped_media_path, media_path
from lakeloader.ingest.media import keep_images
from lakeloader.storage import with_retries, write_atomically, write_failure

log = logging.getLogger(__name__)

# Rewritten files recorded per transaction: a build killed in the pass keeps what it recorded.
RECORD_EVERY = 64


@dataclasses.dataclass
class DedupTotals:
    """What a pass rewrote: media files, and their bytes before and after."""

    files: int = 0
    bytes_before: int = 0
    bytes_after: int = 0


def dedup_media(lake: Lake, writer: CatalogWriter, datasets: Sequence[str]) -> DedupTotals:
    """Rewrite the media files of ``datasets``' committed chunks that hold images a lower chunk
    holds (each read whole and checked against its sha256 first), and record them; call once
    every chunk of the datasets is committed."""
    totals = DedupTotals()
    for name in datasets:
        rewrites = writer.media_rewrites(name)
        if rewrites.empty:
            continue
        current = writer.current_media_files(name)   # (in global order: each home is rewritten first)
        pending: list[MediaFile] = []
        for row in rewrites.itertuples(index=False):
            keep = [str(image) for image in row.keep]
            homes = {str(image["image_id"]): current[int(image["owner"])] for image in row.dropped}
            pending.append(_rewrite(lake, name, int(row.global_index), row.path, row.media_checksum, keep, homes))
            current[pending[-1].global_index] = pending[-1].path
            totals.files += 1
            totals.bytes_before += int(row.media_bytes)
            totals.bytes_after += pending[-1].num_bytes
            if len(pending) >= RECORD_EVERY:
                writer.record_media_files(pending)
                pending = []
        writer.record_media_files(pending)
    if totals.files:
        log.info("images stored once per dataset: %d media files rewritten, %d bytes -> %d bytes", totals.files,
                 totals.bytes_before, totals.bytes_after)
    return totals


def _rewrite(lake: Lake, dataset: str, global_index: int, chunk_path: str, checksum: str,
             keep: Sequence[str], homes: dict[str, str]) -> MediaFile:
    """The media file of chunk ``global_index`` (file ``chunk_path``) whose sha256 is ``checksum``,
    without the images not in ``keep``, naming the home of each other (``homes``), written into
    the lake."""
    source = media_path(chunk_path)
    url = lake.url_of(source)
    data = with_retries(lambda: lake.fs.cat_file(lake.path_of(source)), deadline=lake.io_retry_deadline,
                        what=f"reading the media file {url}")
    if hashlib.sha256(data).hexdigest() != checksum:
        raise ChunkIntegrityError(
            f"media file {url} of chunk {global_index} of dataset {dataset!r} is not as the catalog records it "
            "(sha256): it was altered or damaged. Run `lakeloader verify CONFIG --repair`")
    new, count = keep_images(data, keep, homes)
    digest = hashlib.sha256(new).hexdigest()
    path = deduped_media_path(chunk_path, digest)
    target = lake.url_of(path)
    try:
        with_retries(lambda: write_atomically(target, new, lake.storage_options), deadline=lake.io_retry_deadline,
                     what=f"writing the media file {target}")
    except OSError as exc:
        raise write_failure(f"a media file of dataset {dataset!r}", target, exc) from exc
    return MediaFile(dataset, global_index, path, count, len(new), digest)
