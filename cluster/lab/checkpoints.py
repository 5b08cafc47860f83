"""The rows of the retention lab's checkpoints: stored objects and extents streamed into
``.npy`` members of an ``.npz`` (numpy reads them; nothing is pickled), a batch at a time.

Plain Python beside the compiled simulator (``cluster.lab.native``): numpy's type
stubs say ``dtype_to_descr`` returns a list, where it returns a string for these dtypes,
and compiled code checks what a stub promises.
"""

from __future__ import annotations

import itertools
import struct
import zipfile
from collections.abc import Iterator

import numpy as np

# One row per stored object (digest, kind, size, last use or expiry) and per extent
# (owner, first chunk, end), written and read this many at a time.
STORED_ROW = struct.Struct("<32sbqd")
EXTENT_ROW = struct.Struct("<qqq")
STORED_DTYPE = np.dtype([("digest", "V32"), ("kind", "i1"), ("size", "<i8"), ("time", "<f8")])
EXTENT_DTYPE = np.dtype("<i8")
ROWS_PER_WRITE = 1 << 16


def write_rows(archive: zipfile.ZipFile, name: str, dtype: np.dtype, shape: tuple[int, ...], rows,
               row: struct.Struct) -> None:
    """``rows`` (each packed by ``row``) as ``name.npy`` in ``archive``, an array of
    ``shape`` and ``dtype`` that ``np.load`` reads, without holding them all."""
    written = 0
    with archive.open(name + ".npy", "w", force_zip64=True) as out:
        np.lib.format.write_array_header_2_0(out, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                   "fortran_order": False, "shape": shape})
        while batch := list(itertools.islice(rows, ROWS_PER_WRITE)):
            out.write(b"".join(itertools.starmap(row.pack, batch)))
            written += len(batch)
    if written != shape[0]:
        raise RuntimeError(f"checkpoint: {written} {name} rows written, {shape[0]} expected")


def stored_rows(array: np.ndarray):
    """The rows of a saved tier as :meth:`TieredStore.restore_sized` takes them."""
    for start in range(0, len(array), ROWS_PER_WRITE):
        part = array[start:start + ROWS_PER_WRITE]
        yield from zip(part["digest"].tolist(), part["kind"].tolist(), part["size"].tolist(), part["time"].tolist())


def extent_rows(array: np.ndarray) -> Iterator[list[int]]:
    """The [owner, first, end] rows of a saved extents array, a batch at a time."""
    for start in range(0, len(array), ROWS_PER_WRITE):
        yield from array[start:start + ROWS_PER_WRITE].tolist()
