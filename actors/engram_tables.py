"""Engram tables on disk, and the plain shard reader behind the Engram service.

The released checkpoint stores each Engram layer's table as two safetensors tensors::

    layers.{L}.engram.embed.weight  F8_E4M3 [rows, head_dim]
    layers.{L}.engram.embed.scale   F8_E8M0 [rows, head_dim / 32]

(``model.``-prefixed in Hugging Face exports; small test checkpoints may store float
rows, whose scale is then unused, as in :class:`model.engram_gate.EngramEmbedding`).

A *shard* is the same contiguous fraction of rows of every Engram table. An
:class:`EngramShard` memory-maps exactly its byte ranges of the checkpoint files
(``mmap`` + ``numpy.frombuffer``: nothing is copied at start-up, the kernel pages rows
in on first touch and may evict them under pressure) and answers :class:`ShardRequest`
s with the stored bytes. It knows nothing of Ray; ``actors/engram.py`` wraps it.

Shapes: ``U`` = unique rows asked of one table, ``D`` = ``head_dim``.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.checkpoint_files import tensor_index

__all__ = [
    "EngramTable",
    "EngramShard",
    "ShardPlan",
    "ShardRequest",
    "ShardRows",
    "TensorLocation",
    "read_engram_tables",
]

# safetensors dtype -> (numpy dtype the bytes are read as, kind). BF16 has no numpy
# type: it is read as uint16 and reinterpreted on the model side.
_DTYPES: dict[str, tuple[str, str]] = {
    "F8_E4M3": ("uint8", "fp8"),
    "F8_E8M0": ("uint8", "ue8m0"),
    "U8": ("uint8", "ue8m0"),
    "F32": ("float32", "float"),
    "F16": ("float16", "float"),
    "BF16": ("uint16", "float"),
}


@dataclass(frozen=True)
class TensorLocation:
    """Where one 2-D tensor's bytes sit in a safetensors file.

    ``offset`` is the absolute byte offset of element ``[0, 0]`` in ``path``; rows are
    contiguous, ``row_bytes`` apart.
    """

    path: str
    dtype: str  # safetensors dtype name, e.g. "F8_E4M3"
    shape: tuple[int, int]
    offset: int

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(_DTYPES[self.dtype][0])

    @property
    def row_bytes(self) -> int:
        return self.shape[1] * self.numpy_dtype.itemsize


@dataclass(frozen=True)
class EngramTable:
    """One Engram layer's table in a checkpoint.

    ``weight`` is ``[rows, D]``; ``scale`` is ``[rows, D / 32]`` UE8M0 bytes when the
    weight is FP8, and ``None`` when the weight holds float values (a float table's
    stored scale is unused, as in the model).
    """

    layer_id: int
    weight: TensorLocation
    scale: TensorLocation | None

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    @property
    def head_dim(self) -> int:
        return self.weight.shape[1]

    @property
    def is_fp8(self) -> bool:
        return self.scale is not None


def _table_names(layer_id: int) -> tuple[str, ...]:
    stem = f"layers.{layer_id}.engram.embed"
    return (stem, "model." + stem)


def read_engram_tables(directory: str | Path, layer_ids: tuple[int, ...] | list[int]) -> tuple[EngramTable, ...]:
    """Locate the Engram tables of ``layer_ids`` (in that order) in a checkpoint
    directory by reading only the safetensors headers (:mod:`model.checkpoint_files`,
    which checks that each byte span holds its shape). Raises ``ValueError`` when a
    table is missing, malformed or stored in a dtype the service does not serve."""
    directory = Path(directory)
    found: dict[str, TensorLocation] = {}
    for entry in tensor_index(directory):
        if ".engram.embed." not in entry.name:
            continue
        if len(entry.shape) != 2:
            raise ValueError(f"{entry.path}: {entry.name} has shape {list(entry.shape)}, expected [rows, cols]")
        if entry.dtype not in _DTYPES:
            raise ValueError(f"{entry.path}: {entry.name} is stored as {entry.dtype}; "
                             f"the Engram service reads {sorted(_DTYPES)}")
        found[entry.name] = TensorLocation(str(entry.path.resolve()), entry.dtype, entry.shape, entry.offset)
    tables = []
    for layer_id in layer_ids:
        weight = next((found[n + ".weight"] for n in _table_names(layer_id) if n + ".weight" in found), None)
        scale = next((found[n + ".scale"] for n in _table_names(layer_id) if n + ".scale" in found), None)
        if weight is None:
            raise ValueError(f"{directory}: no Engram table layers.{layer_id}.engram.embed.weight")
        kind = _DTYPES[weight.dtype][1]
        if kind == "fp8":
            if scale is None or _DTYPES[scale.dtype][1] != "ue8m0":
                raise ValueError(f"{directory}: the FP8 Engram table of layer {layer_id} needs UE8M0 scales")
            if scale.shape != (weight.shape[0], weight.shape[1] // 32) or weight.shape[1] % 32:
                raise ValueError(
                    f"{directory}: Engram layer {layer_id}: scale {list(scale.shape)} does not cover "
                    f"weight {list(weight.shape)} in blocks of 32"
                )
        elif kind == "float":
            scale = None
        else:
            raise ValueError(f"{directory}: Engram layer {layer_id} weight is stored as {weight.dtype}")
        tables.append(EngramTable(int(layer_id), weight, scale))
    return tuple(tables)


@dataclass(frozen=True)
class ShardPlan:
    """How the Engram tables are cut into shards.

    ``bounds[t]`` (``n_shards + 1`` ascending ints from 0 to the table's rows) cuts
    table ``t`` (ordered as ``tables``, i.e. as ``engram_layer_ids``); shard ``s`` holds
    rows ``[bounds[t][s], bounds[t][s + 1])`` of every table.
    """

    tables: tuple[EngramTable, ...]
    bounds: tuple[tuple[int, ...], ...]

    @classmethod
    def even(cls, tables: tuple[EngramTable, ...], n_shards: int) -> "ShardPlan":
        """Equal row ranges (to one row) of every table."""
        if n_shards < 1:
            raise ValueError(f"n_shards must be >= 1, got {n_shards}")
        bounds = tuple(tuple(t.rows * s // n_shards for s in range(n_shards + 1)) for t in tables)
        return cls(tables, bounds)

    @property
    def n_shards(self) -> int:
        return len(self.bounds[0]) - 1 if self.bounds else 0

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(t.layer_id for t in self.tables)

    def rows(self, shard: int) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` per table of one shard."""
        return tuple((b[shard], b[shard + 1]) for b in self.bounds)

    def shard_bytes(self, shard: int) -> int:
        """Bytes of the checkpoint one shard maps (weights plus scales)."""
        total = 0
        for table, (start, stop) in zip(self.tables, self.rows(shard)):
            per_row = table.weight.row_bytes + (table.scale.row_bytes if table.scale else 0)
            total += (stop - start) * per_row
        return total


@dataclass(frozen=True)
class ShardRequest:
    """Rows asked of one shard: ``local_ids[t]`` int64 ``[U_t]``, sorted, unique, in
    ``[0, stop - start)`` of the shard's range of table ``t`` (may be empty)."""

    local_ids: tuple[np.ndarray, ...]

    @property
    def n_rows(self) -> int:
        return sum(int(ids.size) for ids in self.local_ids)


@dataclass(frozen=True)
class ShardRows:
    """A shard's answer, as stored: per table ``weight[t]`` ``[U_t, D]`` (uint8 FP8 bits,
    or float32 / float16 / uint16-as-BF16 values) and ``scale[t]`` ``[U_t, D / 32]``
    uint8 UE8M0 bytes (``None`` for float tables), rows in the order asked."""

    weight: tuple[np.ndarray, ...]
    scale: tuple[np.ndarray | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weight) + sum(s.nbytes for s in self.scale if s is not None)


def _map_rows(location: TensorLocation, start: int, stop: int) -> tuple[mmap.mmap | None, np.ndarray]:
    """Read-only zero-copy view ``[stop - start, cols]`` of rows ``[start, stop)``.

    Returns the mmap (to keep alive, ``None`` for an empty range) and the array view."""
    dtype, cols = location.numpy_dtype, location.shape[1]
    if stop <= start:
        return None, np.empty((0, cols), dtype=dtype)
    begin = location.offset + start * location.row_bytes
    length = (stop - start) * location.row_bytes
    aligned = begin - begin % mmap.ALLOCATIONGRANULARITY
    with open(location.path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if begin + length > size:
            raise ValueError(f"{location.path} is {size} bytes; expected at least {begin + length} (a different file on this host?)")
        mapped = mmap.mmap(handle.fileno(), length + begin - aligned, access=mmap.ACCESS_READ, offset=aligned)
    if hasattr(mapped, "madvise"):  # random row lookups: no read-ahead beyond the page
        mapped.madvise(mmap.MADV_RANDOM)
    rows = np.frombuffer(mapped, dtype=dtype, count=(stop - start) * cols, offset=begin - aligned)
    return mapped, rows.reshape(stop - start, cols)


class EngramShard:
    """Rows ``plan.rows(shard)`` of every Engram table, memory-mapped read-only.

    Opening maps byte ranges only (no read, no copy); :meth:`fetch` copies the asked
    rows out (the kernel pages them in from the file or the page cache).
    """

    def __init__(self, plan: ShardPlan, shard: int):
        if not 0 <= shard < plan.n_shards:
            raise ValueError(f"shard {shard} is outside the plan's {plan.n_shards} shards")
        self.plan = plan
        self.shard = shard
        self.ranges = plan.rows(shard)
        self._maps: list[mmap.mmap] = []
        self._weights: list[np.ndarray] = []
        self._scales: list[np.ndarray | None] = []
        for table, (start, stop) in zip(plan.tables, self.ranges):
            self._weights.append(self._map(table.weight, start, stop))
            self._scales.append(None if table.scale is None else self._map(table.scale, start, stop))

    def _map(self, location: TensorLocation, start: int, stop: int) -> np.ndarray:
        mapped, rows = _map_rows(location, start, stop)
        if mapped is not None:
            self._maps.append(mapped)
        return rows

    def fetch(self, request: ShardRequest) -> ShardRows:
        """The stored rows of ``request`` (``ValueError`` for a row outside this shard)."""
        if len(request.local_ids) != len(self._weights):
            raise ValueError(f"request names {len(request.local_ids)} tables, the shard holds {len(self._weights)}")
        weights, scales = [], []
        for t, ids in enumerate(request.local_ids):
            start, stop = self.ranges[t]
            ids = np.asarray(ids, dtype=np.int64)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= stop - start):
                raise ValueError(
                    f"shard {self.shard}: rows asked of Engram layer {self.plan.tables[t].layer_id} fall outside "
                    f"its range [{start}, {stop})"
                )
            weights.append(self._weights[t][ids])  # [U, D], a copy
            scale = self._scales[t]
            scales.append(None if scale is None else scale[ids])  # [U, D / 32]
        return ShardRows(tuple(weights), tuple(scales))

    def close(self) -> None:
        """Drop the mappings (the arrays handed out by :meth:`fetch` are copies)."""
        self._weights.clear()
        self._scales.clear()
        for mapped in self._maps:
            try:
                mapped.close()
            except BufferError:  # a view is still exported; the GC unmaps later
                pass
        self._maps.clear()
