"""Explicit, byte-exact caches of one sequence, owned by the engine.

The bytes are the cache of record, in the released layouts of :mod:`model.formats`
(window entries FP8 with a UE8M0 scale per 32; long-range entries FP4 with an E4M3
scale per 16; indexer keys FP4 with a UE8M0 scale per 32). Each :class:`PackedRows`
also keeps the dequantised values of its rows, which are exactly
``fmt.dequantize(bytes)``: compute reads them instead of decoding the same bytes at
every step.

A :class:`SequenceCache` is what one conversation leaves behind:

- long-range state (kept for days, stored in chunks): per KV-source layer the
  compressed entries and the indexer keys;
- window state (kept for minutes in host RAM): per layer the last ``sliding_window``
  window entries, the hidden states of incomplete pooling groups, and the Engram
  n-gram context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import TextConfig
from ..engram import NgramContext
from ..formats import COMPRESSED_KV, INDEXER_KEY, WINDOW_KV, BlockFormat, Packed


class PackedRows:
    """A growable list of vectors of ``dim`` values stored in one block format.

    ``data`` is ``[n, row_bytes]`` uint8 (payload bytes, then the scale bytes of the
    row); ``values`` ``[n, dim]`` float32 are the same rows dequantised. Capacity
    doubles, so appending one row per decode step is amortised O(1). Rows dropped
    from the front (a window sliding forward) only move an offset; the kept rows are
    moved back to the start of the buffer when an append finds it full, so a window
    sliding one row per step copies its rows once per ``capacity - n`` steps, not at
    every step.
    """

    def __init__(self, fmt: BlockFormat, dim: int, device: torch.device | str = "cpu"):
        """Rows of ``dim`` values in ``fmt``, or float32 when ``dim`` is not a multiple of
        its block (:meth:`BlockFormat.for_width`)."""
        fmt = fmt.for_width(dim)
        self.fmt, self.dim = fmt, dim
        self.payload = fmt.payload_bytes(dim)
        self.row_bytes = fmt.nbytes(dim)
        self._data = torch.empty(0, self.row_bytes, dtype=torch.uint8, device=device)
        self._values = torch.empty(0, dim, dtype=torch.float32, device=device)
        self._first = 0  # the buffer row of row 0
        self.n = 0

    @property
    def device(self) -> torch.device:
        return self._data.device

    @property
    def data(self) -> torch.Tensor:
        return self._data[self._first : self._first + self.n]

    @property
    def values(self) -> torch.Tensor:
        return self._values[self._first : self._first + self.n]

    @property
    def offset(self) -> int:
        """The buffer row of row 0."""
        return self._first

    @property
    def nbytes(self) -> int:
        return self.n * self.row_bytes

    @property
    def allocated_bytes(self) -> int:
        """Memory the rows take, free capacity included: the bytes and their values."""
        return self._data.numel() + self._values.numel() * self._values.element_size()

    def append(self, raw: torch.Tensor) -> torch.Tensor:
        """Quantise ``raw`` [m, dim] and append it; returns the stored values [m, dim]."""
        return self.append_encoded(*self.encode(raw))

    def encode(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``raw`` [m, dim] as :meth:`append` would store it: (bytes [m, row_bytes],
        values [m, dim]). Row by row: the rows of several caches encoded at once get
        the bytes each would get alone."""
        return encode_rows(self.fmt, self.payload, raw)

    def append_bytes(self, rows: torch.Tensor) -> torch.Tensor:
        """Append rows given as bytes [m, row_bytes]; returns their values [m, dim]."""
        if rows.shape[-1] != self.row_bytes:
            raise ValueError(f"rows of {rows.shape[-1]} bytes, expected {self.row_bytes}")
        return self.append_encoded(rows, self.decode(rows))

    def append_encoded(self, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Append rows already encoded (:meth:`encode`): bytes and their values."""
        m = rows.shape[0]
        self._reserve(self.n + m)
        end = self._first + self.n
        self._data[end : end + m] = rows
        self._values[end : end + m] = values
        self.n += m
        return values

    def tail(self, m: int) -> int:
        """Room for ``m`` more rows; returns the buffer row where the first of them goes
        (the caller writes them there, then :meth:`extend`)."""
        self._reserve(self.n + m)
        return self._first + self.n

    def extend(self, m: int) -> None:
        """Count ``m`` rows written after the last (at :meth:`tail`)."""
        self.n += m

    def adopt(self, data: torch.Tensor, values: torch.Tensor) -> None:
        """Keep the rows in ``data`` [C, row_bytes] and ``values`` [C, dim] from now on
        (views of a buffer shared with other rows, :mod:`model.runtime.batch_slab`):
        the rows are copied to their start."""
        data[: self.n], values[: self.n] = self.data, self.values
        self._data, self._values, self._first = data, values, 0

    def holds(self, values: torch.Tensor) -> bool:
        """Whether the rows are still kept in ``values`` (what :meth:`adopt` was given:
        an append that outgrows it moves them to a buffer of their own)."""
        return self._values is values

    def release(self) -> None:
        """Keep the rows in a buffer of their own again (after :meth:`adopt`)."""
        self._data, self._values, self._first = self.data.clone(), self.values.clone(), 0

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        packed = Packed(rows[..., : self.payload], rows[..., self.payload :])
        return self.fmt.dequantize(packed)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows (roll back rows appended by rejected tokens)."""
        self.n = min(self.n, n)

    def drop_front(self, k: int) -> None:
        """Forget the first ``k`` rows (a window sliding forward)."""
        k = min(max(k, 0), self.n)
        self._first += k
        self.n -= k

    def _reserve(self, n: int) -> None:
        """Room for ``n`` rows after ``_first``: move the rows to the start of the buffer
        when that leaves it at most half full, else grow it (either way at least half
        the buffer is free after the move)."""
        capacity = self._data.shape[0]
        if self._first + n <= capacity:
            return
        if 2 * n <= capacity:
            self.to_front()
            return
        rows = slice(self._first, self._first + self.n)
        data = torch.empty(max(n, 2 * capacity, 16), self.row_bytes, dtype=torch.uint8, device=self.device)
        values = torch.empty(data.shape[0], self.dim, dtype=torch.float32, device=self.device)
        data[: self.n], values[: self.n] = self._data[rows], self._values[rows]
        self._data, self._values, self._first = data, values, 0

    def to_front(self) -> None:
        """Move the rows to the start of their buffer (where they stay kept)."""
        if self._first:
            rows = slice(self._first, self._first + self.n)  # (clone: the two ranges may overlap)
            self._data[: self.n] = self._data[rows].clone()
            self._values[: self.n] = self._values[rows].clone()
            self._first = 0


def encode_rows(fmt: BlockFormat, payload: int, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`PackedRows.encode` as a function of the format and its payload bytes per row."""
    packed = fmt.quantize(raw)
    rows = torch.cat((packed.data, packed.scales), dim=-1)
    return rows, fmt.dequantize(Packed(rows[..., :payload], rows[..., payload:]))


@dataclass
class Window:
    """One layer's sliding window: the entries of positions ``[start, start + n)``."""

    rows: PackedRows
    start: int = 0

    @property
    def end(self) -> int:
        return self.start + self.rows.n


@dataclass
class SequenceCache:
    """Everything one sequence leaves behind for its next tokens.

    ``length`` counts the positions whose long-range state is in the cache;
    ``windows[i]`` is ``None`` for a layer whose window has not been built (expired,
    or not yet replayed); ``pending[src]`` holds the normalised hidden states
    ``[k, D]`` of the incomplete pooling group of KV source ``src``.
    """

    config: TextConfig
    length: int = 0
    entries: dict[int, PackedRows] = field(default_factory=dict)
    keys: dict[int, PackedRows] = field(default_factory=dict)
    windows: list[Window | None] = field(default_factory=list)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)
    ngram: NgramContext | None = None

    @classmethod
    def empty(cls, config: TextConfig, device: torch.device | str = "cpu") -> "SequenceCache":
        cache = cls(config=config)
        for plan in config.layer_plans():
            if plan.is_kv_source:
                cache.entries[plan.index] = PackedRows(COMPRESSED_KV, config.head_dim, device)
                cache.keys[plan.index] = PackedRows(INDEXER_KEY, config.index_head_dim, device)
                cache.pending[plan.index] = torch.empty(0, config.hidden_size, device=device)
        cache.windows = [None] * config.num_hidden_layers
        return cache

    def new_window(self, layer: int, start: int) -> Window:
        device = next(iter(self.entries.values())).device if self.entries else "cpu"
        window = Window(PackedRows(WINDOW_KV, self.config.head_dim, device), start)
        self.windows[layer] = window
        return window

    def long_range_bytes(self) -> int:
        """Bytes of the long-range caches (entries + indexer keys)."""
        return sum(r.nbytes for r in self.entries.values()) + sum(r.nbytes for r in self.keys.values())

    def allocated_bytes(self) -> int:
        """Memory the whole cache takes: every row buffer at its capacity (bytes and
        dequantised values), the windows, the pending pooling rows and the n-gram tail."""
        rows = [*self.entries.values(), *self.keys.values(), *(w.rows for w in self.windows if w is not None)]
        tensors = [*self.pending.values(), *([self.ngram.tail] if self.ngram is not None else [])]
        return sum(r.allocated_bytes for r in rows) + sum(t.numel() * t.element_size() for t in tensors)
