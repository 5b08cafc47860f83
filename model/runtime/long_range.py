"""The long-range memory an engine step adds: the pooling groups its tokens complete.

A step's tokens are laid out flat, sequence after sequence (:class:`Segment`: one
sequence's new tokens, its rows of the flat batch and their positions). A KV source
layer pools each sequence's rows into long-range entries and indexer keys
(:func:`pool_groups`) as soon as a group of ``compress_ratio`` rows is complete; the
rows of an incomplete group wait in the cache's ``pending`` rows. A verify step can be
taken back: its :class:`Rewind` keeps what :meth:`model.runtime.engine.Engine.accept`
needs, among it the rows each KV source pooled from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engram import NgramContext
from ..transformer import Block, Transformer
from .batch_slab import BatchSlab
from .cache import SequenceCache


@dataclass
class Rewind:
    """What :meth:`Engine.accept` needs to take back the tokens of a :meth:`Engine.verify`
    step (:mod:`model.runtime.engine`).

    ``length``: the cache length before the step; ``n_tokens``: the tokens the step fed;
    ``ngram``: the n-gram context before the step; ``pooling[src]``: the hidden states
    [n, D] and positions [n] the KV source ``src`` pooled from (its pending rows, then
    the step's), from which the pending group of any accepted prefix is cut.
    """

    length: int
    n_tokens: int
    token_ids: torch.Tensor
    ngram: NgramContext | None
    pooling: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class Segment:
    """New tokens of one sequence inside a flat batch: rows ``[lo, hi)``, at the
    consecutive ``positions`` from ``first``.

    With ``rewind`` set (a verify step) the windows keep the rows a rollback may need
    and the pooling rows are recorded there.
    """

    cache: SequenceCache
    positions: torch.Tensor
    lo: int
    hi: int
    rewind: Rewind | None = None
    first: int = field(init=False)

    def __post_init__(self) -> None:
        self.first = int(self.positions[0]) if len(self.positions) else self.cache.length


def pool_groups(model: Transformer, compiled, block: Block, segments: list[Segment], x: torch.Tensor,
                slab: BatchSlab | None = None, slots: list[int] = ()) -> None:
    """Extend a KV source's long-range entries and indexer keys with the complete
    groups of every sequence's new rows ``x[lo:hi]`` (x [N, D]).

    Positions already covered by stored entries are skipped (so replays never
    rewrite long-range state); the incomplete group's hidden states stay pending.
    A verify step records the rows pooled from in its rewind, for :meth:`Engine.accept`.
    The groups of all sequences are pooled in one call, one group per row, by the
    ``compiled`` step (a :class:`model.runtime.compiled.CompiledBlocks`) where it takes them.
    ``slab``: where the segments' entries and keys are seated, the i-th's in row
    ``slots[i]`` (:class:`~model.runtime.batch_slab.BatchSlab`): the groups are
    appended there, with one copy for all.
    """
    source, ratio = block.plan.index, block.plan.compress_ratio
    one_token = _one_token_each(segments, source, ratio)
    grouped = (_one_token_groups if one_token else _groups)(segments, source, ratio, x)
    if grouped is None:
        return
    rows, row_pos, owners = grouped
    # Row by row, so encoding every sequence's rows at once gives each its own bytes.
    caches = [segments[i].cache for i, _ in owners]
    entry_store, key_store = caches[0].entries[source], caches[0].keys[source]
    if compiled is not None and compiled.handles(rows.shape[0] * rows.shape[1]):
        cos, sin = model.rotary["compress"](row_pos[:, ::ratio])
        entry_rows, key_rows = compiled.pool_groups(block.attn, rows, cos, sin, entry_store, key_store)
    else:
        new_entries, new_keys = block.attn.compress(rows, row_pos, model.rotary["compress"])
        entry_rows, key_rows = entry_store.encode(new_entries.flatten(0, 1)), key_store.encode(new_keys.flatten(0, 1))
    counts = [n_groups for _, n_groups in owners]
    if slab is not None:
        owner_slots = [slots[i] for i, _ in owners]
        slab.append(("entries", source), [c.entries[source] for c in caches], owner_slots, counts, entry_rows)
        slab.append(("keys", source), [c.keys[source] for c in caches], owner_slots, counts, key_rows)
        return
    lo = 0
    for cache, n_groups in zip(caches, counts):
        cache.entries[source].append_encoded(*(t[lo : lo + n_groups] for t in entry_rows))
        cache.keys[source].append_encoded(*(t[lo : lo + n_groups] for t in key_rows))
        lo += n_groups


Groups = tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]
"""A step's complete groups of one KV source: rows [G, ratio, D], their positions
[G, ratio], and (segment, groups) of each segment that completed any, in order."""


def _groups(segments: list[Segment], source: int, ratio: int, x: torch.Tensor) -> Groups | None:
    """The complete groups of every segment's pending and new rows (None: none); the
    rows of an incomplete group become the segment's pending rows."""
    groups, owners = [], []
    for i, segment in enumerate(segments):
        rows, row_pos = _pooled_rows(segment, source, ratio, x)
        if segment.rewind is not None:
            segment.rewind.pooling[source] = (rows, row_pos)
        whole = rows.shape[0] // ratio * ratio
        if whole:
            groups.append((rows[:whole], row_pos[:whole]))
            owners.append((i, whole // ratio))
        segment.cache.pending[source] = rows[whole:]
    if not groups:
        return None
    if len(groups) == 1:
        return groups[0][0][None], groups[0][1][None], owners
    return (torch.cat([g[0] for g in groups]).unflatten(0, (-1, ratio)),
            torch.cat([g[1] for g in groups]).view(-1, ratio), owners)


def _one_token_each(segments: list[Segment], source: int, ratio: int) -> bool:
    """Whether every segment feeds one token right after its pending rows, not to be
    taken back (a decode step; the i-th segment's token is row i): :func:`_one_token_groups`
    then does what :func:`_groups` would."""
    for i, segment in enumerate(segments):
        cache = segment.cache
        if (segment.lo != i or segment.hi != i + 1 or segment.rewind is not None
                or segment.first != cache.entries[source].n * ratio + cache.pending[source].shape[0]):
            return False
    return True


def _one_token_groups(segments: list[Segment], source: int, ratio: int, x: torch.Tensor) -> Groups | None:
    """:func:`_groups` of a decode step (:func:`_one_token_each`) in a few tensor
    operations for the whole batch, not several per sequence: a segment whose pending
    rows are one short of a group completes it."""
    x = x[: len(segments)]  # (a sequence pooled alone may be the first of a longer batch)
    pending = [segment.cache.pending[source] for segment in segments]
    complete = [i for i, rows in enumerate(pending) if rows.shape[0] == ratio - 1]
    none = x[:0]
    for i, (segment, rows) in enumerate(zip(segments, pending)):
        segment.cache.pending[source] = (none if rows.shape[0] == ratio - 1 else
                                         x[i : i + 1] if rows.shape[0] == 0 else torch.cat((rows, x[i : i + 1])))
    if not complete:
        return None
    firsts = torch.tensor([segments[i].first - (ratio - 1) for i in complete], device=x.device)
    new = x if len(complete) == len(segments) else x.index_select(0, torch.tensor(complete, device=x.device))
    rows = new[:, None] if ratio == 1 else torch.cat((torch.stack([pending[i] for i in complete]), new[:, None]), 1)
    return rows, firsts[:, None] + torch.arange(ratio, device=x.device), [(i, 1) for i in complete]


def _pooled_rows(segment: Segment, source: int, ratio: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows [n, D] KV source ``source`` pools from for ``segment``, and their
    positions [n]: its pending rows then the segment's, or the segment's rows past
    those its stored entries cover."""
    cache = segment.cache
    pending, covered = cache.pending[source], cache.entries[source].n * ratio
    if pending.shape[0]:
        if segment.first != covered + pending.shape[0]:
            raise ValueError(f"layer {source}: tokens start at {segment.first}, "
                             f"pending rows end at {covered + pending.shape[0]}")
        rows = torch.cat((pending, x[segment.lo : segment.hi]))
        return rows, torch.arange(covered, covered + rows.shape[0], device=x.device)
    skip = min(max(0, covered - segment.first), segment.hi - segment.lo)
    rows, row_pos = x[segment.lo + skip : segment.hi], segment.positions[skip:]
    if rows.shape[0] and segment.first + skip != covered:
        raise ValueError(f"layer {source}: pooling group starts at {segment.first + skip}, expected {covered}")
    return rows, row_pos
