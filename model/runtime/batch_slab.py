"""The caches of a batch's sequences kept side by side: one buffer per layer's windows,
one per KV source's long-range entries and one per its indexer keys.

A batched step (:class:`model.runtime.gather.CachedKeys`) appends each sequence's new
rows and reads every sequence's rows at every layer. With each sequence's rows in a
buffer of their own, that is a copy per sequence per layer and a padding of every
sequence's rows into one tensor: at batch 16, hundreds of small tensor operations a
step, whichever step (eager or compiled) runs the layers. Here the rows of the
sequences that step together live in one buffer per place (a :data:`Place`: a layer's
window, a source's entries, a source's keys), ``[rows, capacity, ...]``, a row per
sequence: each :class:`~model.runtime.cache.PackedRows` keeps its rows in its row of the
buffer (:meth:`~model.runtime.cache.PackedRows.adopt`), so that a place's new rows of
every sequence are written with one indexed copy (:meth:`BatchSlab.append`), every
window is read with one gather (:meth:`BatchSlab.read_windows`) and the long-range rows
are read where they lie (:meth:`BatchSlab.table`), with no padded copy.

A window buffer's rows hold a window and two steps' tokens, twice (so that a window,
which moves its rows back to the start of its row when an append finds it full, never
outgrows it). A long-range buffer's rows hold the longest sequence's rows and a step's
groups, twice; it grows (every sequence's rows copied to the new one) when a sequence
outgrows it. The long-range buffers together take at most ``max_bytes``, what a step
would otherwise pad (:attr:`model.runtime.engine.Engine.BATCHED_BYTES`); a buffer that
would pass it is not made, and the step pads those rows instead.

A sequence takes a row when it first steps in a batch (:meth:`BatchSlab.admit`) and
gives it back, its rows copied to buffers of their own, at the first batched step
without it. The caches stay the caches of record, with the same rows and bytes: only
where they are kept changes. Everything here runs on the engine's one thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .batch_layout import rows_at
from .cache import PackedRows, SequenceCache, Window

Place = tuple[Literal["window", "entries", "keys"], int]
"""A cache place of every sequence: a layer's window, or a KV source's entries or keys."""


@dataclass(frozen=True)
class WindowStep:
    """A step's window reads and writes where every sequence's windows move in lockstep
    (:meth:`BatchSlab.lockstep`): the same at every layer, so made once a step."""

    append: torch.Tensor  # [M]: the flat buffer row of each new row, the i-th sequence's counts[i] in order
    read: torch.Tensor  # [b, T]: the flat buffer rows each sequence's window is read from (padded)
    firsts: list[int]  # each sequence's first position read
    lengths: list[int]  # and how many rows from it, after the step's new rows
    counts: list[int]  # each sequence's new rows
    trims: list[int]  # rows each window drops from its front after the read


def rows_of(cache: SequenceCache, place: Place) -> PackedRows | None:
    """The cache's rows at ``place`` (None: a window not built)."""
    kind, index = place
    if kind == "window":
        window = cache.windows[index] if index < len(cache.windows) else None
        return None if window is None else window.rows
    return (cache.entries if kind == "entries" else cache.keys).get(index)


@dataclass(frozen=True)
class _Buffer:
    """One place's rows: the bytes [rows, capacity, row bytes] and values [rows,
    capacity, dim], and each row's views (made once: a cache's rows are known to be kept
    in its row by the identity of its view)."""

    data: torch.Tensor
    values: torch.Tensor
    data_of: list[torch.Tensor]
    values_of: list[torch.Tensor]

    @property
    def capacity(self) -> int:
        return self.values.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.values.numel() * self.values.element_size()

    @classmethod
    def of(cls, rows: int, capacity: int, like: PackedRows) -> _Buffer:
        data = torch.zeros(rows, capacity, like.row_bytes, dtype=torch.uint8, device=like.device)
        values = torch.zeros(rows, capacity, like.dim, dtype=torch.float32, device=like.device)
        return cls(data, values, list(data.unbind(0)), list(values.unbind(0)))

    def write(self, index: torch.Tensor, encoded: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Rows ``encoded`` (bytes [M, row bytes], values [M, dim]) at the flat rows ``index`` [M]."""
        for flat, new in zip((self.data, self.values), encoded):
            flat.view(-1, flat.shape[-1]).index_copy_(0, index, new)

    def read(self, index: torch.Tensor) -> torch.Tensor:
        """The values of the flat rows ``index`` (any shape): [*index.shape, dim]."""
        return rows_at(self.values.view(-1, self.values.shape[-1]), index)

    @staticmethod
    def size(rows: int, capacity: int, like: PackedRows) -> int:
        """The bytes of a buffer of ``rows`` x ``capacity`` rows like ``like``'s."""
        return rows * capacity * (like.row_bytes + 4 * like.dim)


class BatchSlab:
    """Rows of cache buffers for the sequences of a batched step (see the module
    docstring): windows of ``window`` places, steps of at most ``step_tokens`` tokens a
    sequence, long-range buffers of at most ``max_bytes`` together."""

    def __init__(self, window: int, step_tokens: int, max_bytes: int = 64 << 20):
        self.window_capacity = 2 * (window + 2 * step_tokens)
        self.step_tokens, self.max_bytes = step_tokens, max_bytes
        self.occupants: list[SequenceCache | None] = []
        self._row_of: dict[int, int] = {}  # id(cache) -> its row
        self._buffers: dict[Place, _Buffer] = {}
        # The last index tensor made for each kind of read or write, by its values: a
        # step's layers mostly repeat their windows' (every window moves alike).
        self._index: dict[str, tuple[tuple, torch.Tensor]] = {}

    def admit(self, caches: list[SequenceCache]) -> list[int]:
        """The rows of a step's ``caches``, in order: each keeps its row, a newcomer
        takes a free one; a sequence the step leaves out gives its row back first."""
        present = {id(cache) for cache in caches}
        for row, cache in enumerate(self.occupants):
            if cache is not None and id(cache) not in present:
                self._evict(row)
        free = [row for row, cache in enumerate(self.occupants) if cache is None]
        if sum(id(cache) not in self._row_of for cache in caches) > len(free):
            self._grow(len(caches))
            free = list(range(len(self.occupants)))
        newcomers = [cache for cache in caches if id(cache) not in self._row_of]
        for cache, row in zip(newcomers, free):
            self.occupants[row] = cache
            self._row_of[id(cache)] = row
        return [self._row_of[id(cache)] for cache in caches]

    def seat(self, place: Place, rows: list[PackedRows], slots: list[int]) -> bool:
        """Put each sequence's ``rows`` at ``place`` in its row ``slots[i]`` (copied there
        unless kept there already); False, and nothing moved, when a window is too long
        for a row or the long-range buffers would pass ``max_bytes`` (the step then
        reads the rows where they are)."""
        buffer = self._room(place, rows)
        if buffer is None:
            return False
        for packed, slot in zip(rows, slots):
            if not packed.holds(buffer.values_of[slot]):
                packed.adopt(buffer.data_of[slot], buffer.values_of[slot])
        return True

    def append(self, place: Place, rows: list[PackedRows], slots: list[int], counts: list[int],
               encoded: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Append new rows to every (seated) sequence's rows at ``place``: ``encoded``
        (bytes [M, row bytes], values [M, dim]), ``counts[i]`` of them for the i-th, in
        order: two indexed copies."""
        buffer = self._buffers[place]
        starts = []
        for packed, slot, m in zip(rows, slots, counts):
            start = slot * buffer.capacity + packed.tail(m)
            if not packed.holds(buffer.values_of[slot]):  # (seating leaves room for a step: never)
                raise RuntimeError(f"{place}: {m} new rows outgrew row {slot} of the slab")
            starts.extend(range(start, start + m))
        index = self._index_of("append", tuple(starts), lambda: torch.tensor(starts, device=encoded[1].device))
        buffer.write(index, encoded)
        for packed, m in zip(rows, counts):
            packed.extend(m)

    def read_windows(self, layer: int, windows: list[Window], slots: list[int], firsts: list[int],
                     lengths: list[int], places: torch.Tensor) -> torch.Tensor:
        """Each (seated) window's ``lengths[i]`` rows from position ``firsts[i]`` on,
        padded: [b, T, dim] for ``places`` = ``arange(T)``, T the longest (a shorter
        window's padding repeats its last row: the caller masks it)."""
        buffer = self._buffers["window", layer]
        starts = [slot * buffer.capacity + window.rows.offset + first - window.start
                  for window, slot, first in zip(windows, slots, firsts)]
        index = self._index_of("window", (*starts, *lengths), lambda: _spans(places, starts, lengths))
        return buffer.read(index)

    def lockstep(self, caches: list[SequenceCache], slots: list[int], counts: list[int], firsts: list[int],
                 window: int, trimmed: list[bool]) -> WindowStep | None:
        """The step's :class:`WindowStep` when every sequence's windows move in lockstep:
        each of its layers has a window, seated here, of the same positions, ending at
        ``firsts[i]`` (where its ``counts[i]`` new tokens start). A sequence's windows
        are built and slide together; where they lie in their rows may part (one rebuilt
        and seated again, rows that reach the end of theirs): those are moved to the
        front of their rows here, all of them, so that they lie alike again. Else None,
        and each layer reads its own. ``window`` the rows a window keeps; ``trimmed[i]``:
        whether the i-th sequence's windows drop their excess after the read (a verify's
        wait for accept)."""
        layers = len(caches[0].windows)
        buffers = [self._buffers.get(("window", layer)) for layer in range(layers)]
        if any(buffer is None for buffer in buffers):
            return None
        values_of = [buffer.values_of for buffer in buffers]
        capacity = self.window_capacity
        append, read_firsts, lengths, starts, trims = [], [], [], [], []
        for cache, slot, m, first, trim in zip(caches, slots, counts, firsts, trimmed):
            windows = cache.windows
            if windows[0] is None:
                return None
            start, n, offset = windows[0].start, windows[0].rows.n, windows[0].rows.offset
            if start + n != first or n + m > capacity:  # (a row too short for them: each layer's own append)
                return None
            alike = True
            for buffer_rows, kept in zip(values_of, windows):
                if kept is None or kept.start != start or kept.rows.n != n or not kept.rows.holds(buffer_rows[slot]):
                    return None
                alike = alike and kept.rows.offset == offset
            if not alike or offset + n + m > capacity:
                for kept in windows:
                    kept.rows.to_front()
                offset = 0
            row = slot * capacity + offset
            append.extend(range(row + n, row + n + m))
            read_first = max(start, first - window + 1)  # what the first new token reads on
            read_firsts.append(read_first)
            lengths.append(first + m - read_first)
            starts.append(row + read_first - start)
            trims.append(max(0, n + m - window) if trim else 0)
        device = caches[0].windows[0].rows.device
        places = torch.arange(max(lengths), device=device)
        return WindowStep(torch.tensor(append, device=device), _spans(places, starts, lengths), read_firsts, lengths,
                          counts, trims)

    def write_windows(self, layer: int, step: WindowStep, encoded: tuple[torch.Tensor, torch.Tensor]) -> None:
        """:meth:`append` of a lockstep ``step``'s new rows at ``layer``: the buffer rows
        only (the caller counts them in each window's rows)."""
        self._buffers["window", layer].write(step.append, encoded)

    def read_lockstep(self, layer: int, step: WindowStep) -> torch.Tensor:
        """:meth:`read_windows` of a lockstep ``step`` at ``layer``: [b, T, dim]."""
        return self._buffers["window", layer].read(step.read)

    def _index_of(self, kind: str, key: tuple, make) -> torch.Tensor:
        """The index tensor of ``kind`` for ``key`` (its values): the last one made when
        the key is the same, else ``make()``."""
        last = self._index.get(kind)
        if last is None or last[0] != key:
            last = self._index[kind] = key, make()
        return last[1]

    def table(self, place: Place) -> torch.Tensor:
        """The values of every row at ``place``: [rows, capacity, dim], a seated
        sequence's rows from the start of its row (the rest is stale: masked by the
        reader)."""
        return self._buffers[place].values

    def _room(self, place: Place, rows: list[PackedRows]) -> _Buffer | None:
        """The buffer of ``place`` with room for every one of ``rows`` and a step's new
        rows (made or grown here), or None."""
        longest = max(packed.n for packed in rows)
        buffer = self._buffers.get(place)
        if place[0] == "window":
            if longest > self.window_capacity // 2:
                return None
            if buffer is None:
                buffer = self._buffers[place] = _Buffer.of(len(self.occupants), self.window_capacity, rows[0])
            return buffer
        need = longest + self.step_tokens
        if buffer is not None and buffer.capacity >= need:
            return buffer
        capacity = 1 << max(6, (2 * need - 1).bit_length())
        others = sum(held.nbytes for kept, held in self._buffers.items() if kept[0] != "window" and kept != place)
        if others + _Buffer.size(len(self.occupants), capacity, rows[0]) > self.max_bytes:
            return None
        grown = self._buffers[place] = _Buffer.of(len(self.occupants), capacity, rows[0])
        if buffer is not None:  # every occupant kept there moves with it
            for slot, cache in enumerate(self.occupants):
                packed = None if cache is None else rows_of(cache, place)
                if packed is not None and packed.holds(buffer.values_of[slot]):
                    packed.adopt(grown.data_of[slot], grown.values_of[slot])
        return grown

    def _evict(self, row: int) -> None:
        """Give ``row`` back: its sequence's rows kept there move to buffers of their own."""
        cache = self.occupants[row]
        for place, buffer in self._buffers.items():
            packed = rows_of(cache, place)
            if packed is not None and packed.holds(buffer.values_of[row]):
                packed.release()
        self.occupants[row] = None
        del self._row_of[id(cache)]

    def _grow(self, rows: int) -> None:
        """Room for ``rows`` sequences: every occupant gives its row back (its rows are
        seated again, in the new buffers, as its next steps reach them)."""
        for row, cache in enumerate(self.occupants):
            if cache is not None:
                self._evict(row)
        self.occupants = [None] * max(rows, 2 * len(self.occupants))
        self._buffers = {}


def _spans(places: torch.Tensor, starts: list[int], lengths: list[int]) -> torch.Tensor:
    """Flat buffer rows [b, T] of spans of ``lengths[i]`` rows from row ``starts[i]``, for
    ``places`` = ``arange(T)``, T the longest: a shorter span's tail repeats its last row."""
    spans = torch.tensor([lengths, starts], device=places.device)
    return torch.minimum(places, spans[0, :, None] - 1) + spans[1, :, None]
