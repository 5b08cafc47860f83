"""The retention lab's checkpoints: a scale-mode run's whole state in an ``.npz``
(numpy reads it; nothing is pickled), the run's counters and pending turns as JSON, the
stored objects and extents streamed into ``.npy`` members a batch at a time.

Plain Python beside the compiled simulator (``cluster.lab.native``): numpy's type
stubs say ``dtype_to_descr`` returns a list, where it returns a string for these dtypes,
and compiled code checks what a stub promises.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import struct
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from cluster.lab.workload import Request

# The layout of a checkpoint (a checkpoint of another layout is refused).
CHECKPOINT_FORMAT = 2

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


def save(path: Path, meta: dict, tiers: dict[str, tuple[int, Iterable]], extents: tuple[int, Iterable]) -> None:
    """Write a checkpoint atomically: ``meta`` (JSON), each tier's (count, stored rows),
    the (count, [owner, first, end] rows) of the extents."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        with archive.open("meta.npy", "w", force_zip64=True) as out:
            np.lib.format.write_array(out, np.array(json.dumps({"format": CHECKPOINT_FORMAT, **meta})))
        for tier, (count, rows) in tiers.items():
            write_rows(archive, tier, STORED_DTYPE, (count,), iter(rows), STORED_ROW)
        count, rows = extents
        write_rows(archive, "extents", EXTENT_DTYPE, (count, 3), iter(rows), EXTENT_ROW)
    tmp.replace(path)


@contextlib.contextmanager
def opened(path: Path, config: dict):
    """(meta, the archive's arrays) of a checkpoint :func:`save` wrote for a run of
    ``config`` (one of another layout or other settings is refused: ValueError)."""
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"the checkpoint {path} was written by another version of the simulator "
                             "(remove it to start the run over)")
        if meta["config"] != config:
            raise ValueError(f"the checkpoint {path} was written by a run with other settings")
        yield meta, data


def request_fields(request: Request) -> dict:
    """A request as JSON fields."""
    return request._asdict()


def request_of(fields: dict) -> Request:
    """The request of :func:`request_fields`' fields (JSON's lists back to tuples)."""
    def runs(value):
        return tuple(tuple(run) for run in value)

    return Request(**{**fields, "runs": runs(fields["runs"]), "after": runs(fields["after"]),
                      "window": None if fields["window"] is None else tuple(fields["window"]),
                      "resume": None if fields["resume"] is None else tuple(fields["resume"])})
