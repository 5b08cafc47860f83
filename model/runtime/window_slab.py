"""The windows of a batch's sequences kept side by side, one buffer per layer.

A batched step (:class:`model.runtime.gather.CachedKeys`) appends each sequence's new
window rows and reads each sequence's window at every layer. With each window in a
buffer of its own, that is a copy per sequence per layer and a padding of every
sequence's rows into one tensor: at batch 16, hundreds of small tensor operations a
step, whichever step (eager or compiled) runs the layers. Here the windows of the
sequences that step together live in one buffer per layer, ``[rows, capacity, ...]``,
a row per sequence: each :class:`~model.runtime.cache.PackedRows` keeps its rows in its
row of the buffer (:meth:`~model.runtime.cache.PackedRows.adopt`), so that a layer's new
rows of every sequence are written with one indexed copy (:meth:`WindowSlab.append`)
and every sequence's window places are read with one gather (:meth:`WindowSlab.read`).

A sequence takes a row when it first steps in a batch (:meth:`WindowSlab.admit`) and
gives it back, its windows copied to buffers of their own, at the first batched step
without it. The windows stay the caches of record, with the same rows and bytes: only
where they are kept changes. Everything here runs on the engine's one thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import PackedRows, SequenceCache, Window


@dataclass(frozen=True)
class _Buffer:
    """One layer's rows: the bytes [rows, capacity, row bytes] and values [rows,
    capacity, dim], and each row's views (made once: a window is known to be kept in
    its row by the identity of its view)."""

    data: torch.Tensor
    values: torch.Tensor
    data_of: list[torch.Tensor]
    values_of: list[torch.Tensor]

    @classmethod
    def of(cls, rows: int, capacity: int, like: PackedRows) -> _Buffer:
        data = torch.zeros(rows, capacity, like.row_bytes, dtype=torch.uint8, device=like.device)
        values = torch.zeros(rows, capacity, like.dim, dtype=torch.float32, device=like.device)
        return cls(data, values, list(data.unbind(0)), list(values.unbind(0)))


class WindowSlab:
    """Rows of window buffers for the sequences of a batched step: ``layers`` buffers,
    each ``[rows, capacity, row bytes]`` (the FP8 bytes) and ``[rows, capacity, dim]``
    (their values), made at the first window of their layer. ``capacity`` holds a
    window of ``window`` places plus the tokens of two steps of ``step_tokens``, twice
    (so that :class:`~model.runtime.cache.PackedRows`, which moves its rows back to the
    start of its buffer when an append finds it full, never outgrows it)."""

    def __init__(self, layers: int, window: int, step_tokens: int):
        self.capacity = 2 * (window + 2 * step_tokens)
        self.layers = layers
        self.occupants: list[SequenceCache | None] = []
        self._row_of: dict[int, int] = {}  # id(cache) -> its row
        self._buffers: list[_Buffer | None] = [None] * layers

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

    def seat(self, layer: int, windows: list[Window], rows: list[int]) -> bool:
        """Put each window of ``layer`` in its sequence's row (copied there unless it is
        already kept there); False, and nothing moved, when a window is too long for a
        row (the step then reads the windows where they are)."""
        if any(window.rows.n > self.capacity // 2 for window in windows):
            return False
        buffer = self._buffer(layer, windows[0].rows)
        for window, row in zip(windows, rows):
            if not window.rows.holds(buffer.values_of[row]):
                window.rows.adopt(buffer.data_of[row], buffer.values_of[row])
        return True

    def append(self, layer: int, windows: list[Window], rows: list[int], counts: list[int],
               encoded: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Append the step's new rows of every (seated) window: ``encoded`` (bytes [N,
        row bytes], values [N, dim]), ``counts[i]`` of them for the i-th window, in
        order: two indexed copies."""
        places = []
        for window, row, m in zip(windows, rows, counts):
            start = row * self.capacity + window.rows.tail(m)
            places.extend(range(start, start + m))
        index = torch.tensor(places, device=encoded[1].device)
        buffer = self._buffer(layer, windows[0].rows)
        for flat, new in zip((buffer.data, buffer.values), encoded):
            flat.view(-1, flat.shape[-1]).index_copy_(0, index, new)
        for window, m in zip(windows, counts):
            window.rows.extend(m)

    def read(self, layer: int, windows: list[Window], rows: list[int], firsts: list[int], lengths: list[int],
             places: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each (seated) window's ``lengths[i]`` rows from position ``firsts[i]`` on,
        padded: [b, T, dim] for ``places`` = ``arange(T)``, T the longest (a shorter
        window's padding repeats its last row: the caller masks it); and ``firsts`` and
        ``lengths`` as one tensor [2, b]."""
        starts = [row * self.capacity + window.rows.offset + first - window.start
                  for window, row, first in zip(windows, rows, firsts)]
        spans = torch.tensor([firsts, lengths, starts], device=places.device)
        index = torch.minimum(places, spans[1, :, None] - 1) + spans[2, :, None]  # [b, T]
        values = self._buffer(layer, windows[0].rows).values
        return values.view(-1, values.shape[-1]).index_select(0, index.view(-1)).view(*index.shape, -1), spans[:2]

    def _buffer(self, layer: int, like: PackedRows) -> _Buffer:
        if self._buffers[layer] is None:
            self._buffers[layer] = _Buffer.of(len(self.occupants), self.capacity, like)
        return self._buffers[layer]

    def _evict(self, row: int) -> None:
        """Give ``row`` back: its sequence's windows kept there move to buffers of their own."""
        cache = self.occupants[row]
        for layer, buffers in enumerate(self._buffers):
            window = cache.windows[layer] if layer < len(cache.windows) else None
            if buffers is not None and window is not None and window.rows.holds(buffers.values_of[row]):
                window.rows.release()
        self.occupants[row] = None
        del self._row_of[id(cache)]

    def _grow(self, rows: int) -> None:
        """Room for ``rows`` sequences: every occupant gives its row back (its windows
        are seated again, in the new buffers, as its next steps reach them)."""
        for row, cache in enumerate(self.occupants):
            if cache is not None:
                self._evict(row)
        self.occupants = [None] * max(rows, 2 * len(self.occupants))
        self._buffers = [None] * self.layers
