"""A checkpoint's safetensors files: which they are, where each tensor sits, its bytes.

The one reader of the safetensors format in the project. A file is an 8-byte
little-endian header length ``N``, ``N`` bytes of JSON mapping each tensor name to
``{dtype, shape, data_offsets: [begin, end)}`` (offsets relative to the data section,
which starts at ``8 + N``; an optional ``__metadata__`` entry holds strings), then the
data section: every tensor's bytes, row-major, little-endian.

:func:`tensor_index` reads only the headers and gives each tensor's absolute byte
offset, so that a reader may map rows in place (the Engram service) or read a
worker's share and nothing else (the loader, with :func:`read_tensors`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """The checkpoint directory is incomplete, malformed, or does not match its config."""


# safetensors dtype name -> torch dtype of its elements.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}
_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes sit: ``nbytes`` bytes from absolute byte ``offset`` of
    ``path``, holding ``shape`` elements of safetensors dtype ``dtype`` row-major."""

    name: str
    path: Path
    dtype: str  # the safetensors name, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when there is one."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no safetensors files in {directory}")
    return shards


def file_header(path: Path) -> bytes:
    """The JSON header of one safetensors file, as stored."""
    with open(path, "rb") as handle:
        (length,) = _LENGTH.unpack(handle.read(_LENGTH.size))
        header = handle.read(length)
    if len(header) != length:
        raise CheckpointError(f"{path}: header cut short")
    return header


def file_entries(path: Path) -> list[TensorEntry]:
    """Every tensor of one safetensors file, in the order of its bytes (headers only).
    A tensor whose byte span does not hold its shape in its dtype is an error."""
    header = file_header(path)
    data_start = _LENGTH.size + len(header)
    entries = []
    for name, info in json.loads(header).items():
        if name == "__metadata__":
            continue
        begin, end = (int(v) for v in info["data_offsets"])
        shape = tuple(int(v) for v in info["shape"])
        dtype = DTYPES.get(info["dtype"])
        if end < begin or (dtype is not None and end - begin != math.prod(shape) * dtype.itemsize):
            raise CheckpointError(f"{path}: {name} spans {end - begin} bytes, not {list(shape)} of {info['dtype']}")
        entries.append(TensorEntry(name, path, info["dtype"], shape, data_start + begin, end - begin))
    return sorted(entries, key=lambda entry: entry.offset)


def tensor_index(directory: Path) -> list[TensorEntry]:
    """Every tensor of a checkpoint, file by file in byte order (headers only)."""
    return [entry for path in checkpoint_files(directory) for entry in file_entries(path)]


def read_tensors(directory: Path, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(stored name, tensor) for every tensor of the checkpoint whose name ``keep``
    accepts (default all), read lazily in byte order; the others are not read."""
    for path in checkpoint_files(directory):
        wanted = [entry for entry in file_entries(path) if keep is None or keep(entry.name)]
        if not wanted:
            continue
        with open(path, "rb") as handle:
            for entry in wanted:
                yield entry.name, _read(handle, entry)


def _read(handle, entry: TensorEntry) -> torch.Tensor:
    """One tensor's bytes from an open file, in a tensor of its own (a copy, not a map)."""
    dtype = DTYPES.get(entry.dtype)
    if dtype is None:
        raise CheckpointError(f"{entry.path}: {entry.name} is stored as {entry.dtype}, which is not read")
    data = torch.empty(entry.nbytes, dtype=torch.uint8)
    handle.seek(entry.offset)
    if entry.nbytes and handle.readinto(data.numpy()) != entry.nbytes:
        raise CheckpointError(f"{entry.path}: {entry.name} is cut short")
    return data.view(dtype).view(entry.shape)
