"""How a step's tokens and its sequences' rows are laid out for cache reads batched
over the sequences (:class:`~model.runtime.gather.CachedKeys`): each token's sequence
and place (:class:`Layout`), a KV source's long-range rows side by side
(:class:`LongRangeRows`), row gathers by index (:func:`rows_at`, :func:`table_rows`),
and what a layer's reads give its attention (:class:`LayerKeys`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


def rows_at(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a table [E, d] and an index of any shape, one row copy per
    index (``index_select``). Advanced indexing on CPU copies element by element: at a
    batch-16 step's sizes it was 3.5-7x slower, and a padded verify step spent more
    time in it than in its matmuls."""
    return table.index_select(0, index.reshape(-1)).view(*index.shape, table.shape[-1])


def table_rows(table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``table[rows[i], index[i]]`` for each i: a table [R, E, d], an index [N, ...] and
    each one's row [N] -> [N, ..., d]."""
    offsets = (rows * table.shape[1]).view(-1, *[1] * (index.dim() - 1))
    return rows_at(table.flatten(0, 1), index + offsets)


@dataclass(frozen=True)
class Layout:
    """The N tokens of a step whose cache reads are batched over its b sequences.

    The indexer scores each sequence's queries against that sequence's keys, shared
    by its tokens: queries laid out [b, n], each sequence's tokens from its row's start
    (when the sequences feed different counts, a verify of each one's own number of
    guesses, the rows' tails are padding). Everything after the scores is per token:
    [N, ...], so a padded slot costs only its share of the scoring."""

    owner: torch.Tensor  # [N]: each token's sequence
    slots: torch.Tensor | None  # [N]: each token's place in [b * n]; None when every sequence feeds n
    b: int
    n: int

    @classmethod
    def of(cls, counts: Sequence[int], device: torch.device) -> Layout:
        b, n = len(counts), max(counts)
        owner = torch.arange(b, device=device).repeat_interleave(torch.tensor(counts, device=device))
        slots = None if min(counts) == n else torch.cat(
            [torch.arange(i * n, i * n + m, device=device) for i, m in enumerate(counts)])
        return cls(owner, slots, b, n)

    def padded(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-token rows [N, ...] as [b, n, ...]: each token at its slot, zeros elsewhere."""
        if self.slots is None:
            return rows.view(self.b, self.n, *rows.shape[1:])
        out = rows.new_zeros(self.b * self.n, *rows.shape[1:])
        return out.index_put_((self.slots,), rows).view(self.b, self.n, *rows.shape[1:])

    def tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows laid out [b, n, ...] as the tokens' [N, ...] (padding dropped)."""
        rows = rows.flatten(0, 1)
        return rows if self.slots is None else rows.index_select(0, self.slots)

    def each(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-sequence rows [b, ...] as each token's sequence's row [N, ...]."""
        if self.slots is None:  # (one token a sequence: the rows themselves)
            return rows if self.n == 1 else rows[:, None].expand(self.b, self.n, *rows.shape[1:]).flatten(0, 1)
        return rows.index_select(0, self.owner)

    def rows_at(self, table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``table[rows[i], index[i]]`` for each token i: a table [R, E, d] of rows
        (default: one per sequence, ``rows`` = ``owner``) and an index [N, ...] -> [N, ..., d]."""
        return table_rows(table, index, self.owner if rows is None else rows)


@dataclass(frozen=True)
class LongRangeRows:
    """A KV source's long-range rows for a batched step: the ``entries`` and ``keys``
    tables [R, E, d] (each sequence's rows padded, or the step's
    :class:`~model.runtime.batch_slab.BatchSlab` buffers), ``row`` [N]: each token's
    row of them, and ``scored`` [b, W, d]: each sequence's keys, W the most a sequence
    has (the places past a sequence's own are masked by its queries' visibility)."""

    entries: torch.Tensor
    keys: torch.Tensor
    row: torch.Tensor
    scored: torch.Tensor


def padded_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Row lists [n_i, d] as one [b, max n_i, d] tensor, zero-padded (one list: a view)."""
    return rows[0][None] if len(rows) == 1 else torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


class LayerKeys(NamedTuple):
    """One layer's keys for a step's N tokens, in two parts that attention reads as
    one: each token's ``window`` places [N, Tw, hd] (``window_mask`` [N, Tw]) and, past
    a Window layer, the long-range entries its indexer ``picked`` [N, k, hd]
    (``picked_valid`` [N, k]; None at a Window layer)."""

    window: torch.Tensor
    window_mask: torch.Tensor
    picked: torch.Tensor | None = None
    picked_valid: torch.Tensor | None = None

    def joined(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts side by side: (keys [N, Tw + k, hd], mask [N, Tw + k])."""
        if self.picked is None:
            return self.window, self.window_mask
        return torch.cat((self.window, self.picked), dim=1), torch.cat((self.window_mask, self.picked_valid), dim=1)


def padded_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence keys [n_i, T_i, ...] or masks [n_i, T_i] as one [sum n_i, max T_i, ...],
    each padded along T with zeros (masked: False)."""
    width = max(part.shape[1] for part in parts)
    return torch.cat([F.pad(part, (0, 0) * (part.dim() - 2) + (0, width - part.shape[1])) for part in parts])
