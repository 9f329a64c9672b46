"""Write a range of batches to an ``.npz`` file with memory bounded by about one batch.

``np.savez`` needs every array in memory at once; here each field is streamed, batch after
batch, into its own ``.npy`` file beside the output, and the ``.npy`` files are then copied
into the zip archive (stored, as ``np.savez`` does) and the archive renamed into place, so the
file is complete or absent. ``np.load`` reads it exactly as a ``np.savez`` file.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipfile
from typing import IO

import numpy as np
from tqdm import tqdm

from lakeloader.feed.loader import Loader

_COPY_BLOCK = 1 << 20


def _open_npy(path: str, dtype: np.dtype, shape: tuple[int, ...]) -> IO[bytes]:
    """A file positioned after the ``.npy`` header of an array of ``shape``, ready for its data."""
    header = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    offset = header.offset
    del header  # only the header is written through the map; the data goes through write()
    handle = open(path, "r+b")
    handle.seek(offset)
    return handle


DATASET_NAMES = "dataset_names"   # the archive's member naming what ``dataset_ids`` number


def write_batches(loader: Loader, first: int, stop: int, out: str | os.PathLike[str], *,
                  progress: bool = True) -> tuple[str, dict[str, tuple[int, ...]]]:
    """Write ``loader``'s batches ``[first, stop)`` to ``out`` (``.npz`` appended when missing,
    as ``np.savez`` does): one array per field shaped ``[stop - first, *batch_shape]``, the same
    keys, dtypes and values as ``np.savez(out, **stacked_batches)``, and ``dataset_names`` (a
    string array: the datasets ``dataset_ids`` number, in order). Holds about one batch in
    memory; shows a progress bar on stderr unless ``progress`` is false. Returns the file
    written and each field's shape."""
    out = os.fspath(out)
    if not out.endswith(".npz"):
        out += ".npz"
    count = stop - first
    folder = tempfile.mkdtemp(prefix=".batches-", dir=os.path.dirname(os.path.abspath(out)))
    files: dict[str, IO[bytes]] = {}
    pickled: dict[str, list[np.ndarray]] = {}  # object fields (image references): small, kept in memory
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        with tqdm(total=count, desc="batches", unit="batch", file=sys.stderr, disable=not progress) as bar:
            for step in range(first, stop):
                batch = loader.batch(step)
                for name, values in batch.items():
                    if name not in shapes:
                        shapes[name] = (count, *values.shape)
                        if values.dtype == object:
                            pickled[name] = []
                        else:
                            files[name] = _open_npy(os.path.join(folder, f"{name}.npy"), values.dtype, shapes[name])
                    if name in pickled:
                        pickled[name].append(values)
                    else:
                        files[name].write(np.ascontiguousarray(values).tobytes())
                bar.update()
        for handle in files.values():
            handle.close()
        temporary = os.path.join(folder, "out.npz")
        with zipfile.ZipFile(temporary, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name in shapes:  # the batch's field order, as np.savez writes it
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    if name in pickled:
                        np.lib.format.write_array(member, np.stack(pickled[name]), allow_pickle=True)
                        continue
                    with open(os.path.join(folder, f"{name}.npy"), "rb") as source:
                        shutil.copyfileobj(source, member, _COPY_BLOCK)
            with archive.open(f"{DATASET_NAMES}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.array(loader.dataset_names, dtype=str), allow_pickle=False)
        os.replace(temporary, out)
    finally:
        for handle in files.values():
            handle.close()
        shutil.rmtree(folder, ignore_errors=True)
    return out, shapes
