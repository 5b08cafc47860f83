"""Which places each query reads: its window, the long-range entries it can see, and
the indexer's selection among those (:func:`select_entries`: scores -> candidate
blocks -> top-k), the one rule every path runs (the reference forward, training, the
engine's eager and compiled steps).

The hierarchical sparse indexer: a candidate-source layer groups the entries into
blocks of ``candidate_block_size``, keeps the ``candidate_topk_blocks`` best blocks
(the newest visible one always) as the pool, and the Reindex layers after it pick only
inside that pool. Every top-k breaks ties by the lower index (:func:`top_k`), so two
paths that score identically pick identically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import LayerPlan, TextConfig


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[..., S] query and [..., T] key positions -> bool [..., S, T]: causal, last ``window`` tokens."""
    delta = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    return (delta >= 0) & (delta < window)


def visible_entries(q_pos: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """bool [..., S, T]: entry ``e`` is visible once the query passed its last token."""
    entries = torch.arange(n_entries, device=q_pos.device)
    return entries < ((q_pos.long() + 1) // ratio).unsqueeze(-1)


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of ``scores`` [..., T] along the last dimension, ties going to the
    lower index: (indices [..., k] ascending, their scores).

    Equal scores are common, not rare: an indexer score is a weighted sum of ReLUs, so
    every entry all of whose head products are negative scores exactly 0, and a block
    of such entries ties too. ``torch.topk`` breaks ties as its kernel happens to (it
    differs with the tensor's width and the CPU), which would let two paths that score
    identically pick differently; this rule depends on the scores alone. It is one
    ``topk`` over keys that order by score, then by lower index (:func:`_ranked`): no
    branch and no read back to the host, so the compiled step runs it too.
    """
    k = min(k, scores.shape[-1])
    indices = _ranked(scores).topk(k, dim=-1).indices.sort(dim=-1).values
    return indices, scores.gather(-1, indices)


def _ranked(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys [..., T] that order as ``scores`` (float32) do, equal scores by lower
    index first: the float's bits made monotone in the high half (-0 read as +0; a
    negative float's magnitude bits flipped), the index's complement in the low half."""
    bits = scores.float().masked_fill(scores == 0, 0.0).view(torch.int32)
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    position = torch.arange(scores.shape[-1], device=scores.device)
    return (monotone << 32) | (0xFFFFFFFF - position)


def unseen_masked(scores: torch.Tensor, n_visible: torch.Tensor) -> torch.Tensor:
    """``scores`` [..., T] with the entries its queries cannot see yet (at or past
    ``n_visible`` [...]) at -inf."""
    visible = torch.arange(scores.shape[-1], device=scores.device) < n_visible[..., None]
    return scores.masked_fill(~visible, float("-inf"))


def pool_masked(scores: torch.Tensor, entries: torch.Tensor, valid: torch.Tensor,
                n_visible: torch.Tensor) -> torch.Tensor:
    """``scores`` [..., P] of a listed pool's ``entries`` [..., P] with those not
    ``valid`` or not visible yet (the newest block is partial) at -inf."""
    return scores.masked_fill(~(valid & (entries < n_visible[..., None])), float("-inf"))


def _top_blocks(scores: torch.Tensor, n_visible: torch.Tensor, topk_blocks: int, block: int):
    """Block scores (best entry of each block; the newest visible block pinned to +inf)
    and their top ``topk_blocks``: returns (block indices, their scores)."""
    width = scores.shape[-1]
    padded = F.pad(scores, (0, -width % block), value=float("-inf"))
    block_scores = padded.unflatten(-1, (-1, block)).amax(dim=-1)
    n_blocks = block_scores.shape[-1]
    newest = ((n_visible - 1) // block).unsqueeze(-1)
    block_scores = block_scores.masked_fill(torch.arange(n_blocks, device=scores.device) == newest, float("inf"))
    return top_k(block_scores, topk_blocks)


def candidate_blocks(scores: torch.Tensor, n_visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """The hierarchical sparse indexer's first level.

    ``scores`` [..., T] with invisible entries at -inf; ``n_visible`` [...] entries
    visible to each query. Entries group into blocks of ``block``; a block scores its
    best entry; the block holding the newest visible entry is always kept; the top
    ``topk_blocks`` reachable blocks form the pool. Returns bool [..., T].
    """
    width = scores.shape[-1]
    indices, values = _top_blocks(scores, n_visible, topk_blocks, block)
    n_blocks = -(-width // block)
    keep = torch.zeros(*scores.shape[:-1], n_blocks, dtype=torch.bool, device=scores.device)
    keep.scatter_(-1, indices, values > float("-inf"))
    return keep.repeat_interleave(block, dim=-1)[..., :width]


def candidate_entries(
    scores: torch.Tensor, n_visible: torch.Tensor, topk_blocks: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`candidate_blocks` as entry indices: ([..., topk_blocks * block], valid).

    The same pool, listed instead of masked, so that a Reindex layer gathers and
    scores only its candidates (its cost stops growing with the context).
    """
    width = scores.shape[-1]
    indices, values = _top_blocks(scores, n_visible, topk_blocks, block)
    entries = (indices.unsqueeze(-1) * block + torch.arange(block, device=scores.device)).flatten(-2)
    valid = (values > float("-inf")).repeat_interleave(block, dim=-1) & (entries < width)
    return entries.clamp_max(width - 1), valid


Pool = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A candidate source's pool as its Reindex layers read it: a mask [..., T] over every
entry (they score every entry: the reference, training), or a list of entries and
their validity ([..., P], [..., P]: they score only their candidates, the engine)."""


@dataclass(frozen=True)
class Selection:
    """One indexer's choice for its queries: ``index`` [..., k] entry indices and
    ``valid`` [..., k] (False where fewer than ``k`` entries could be picked); ``pool``
    the candidate pool a candidate-source layer hands the Reindex layers after it
    (None on other layers)."""

    index: torch.Tensor
    valid: torch.Tensor
    pool: Pool | None = None

    def mask(self, n_entries: int) -> torch.Tensor:
        """The choice as bool [..., n_entries] (True = picked)."""
        out = torch.zeros(*self.index.shape[:-1], n_entries, dtype=torch.bool, device=self.index.device)
        return out.scatter_(-1, self.index, self.valid)


def select_entries(scores: torch.Tensor, n_visible: torch.Tensor, k: int, plan: LayerPlan, config: TextConfig,
                   pool: Pool | None = None, make_pool: Callable[..., Pool] = candidate_blocks) -> Selection:
    """The indexer's selection, on every path: scores -> candidate blocks -> top ``k``.

    ``scores`` [..., T] of the queries that see the entries below ``n_visible`` [...]
    (the rest are not complete yet): of every entry, or, for a Reindex layer handed a
    listed ``pool``, of the pool's entries only [..., P]. A Reindex layer picks inside
    ``pool``; a candidate-source layer makes the pool for the layers after it with
    ``make_pool`` (:func:`candidate_blocks` for a mask, :func:`candidate_entries` for a
    list); then the ``k`` best remaining entries are picked.
    """
    listed = plan.candidate_source is not None and isinstance(pool, tuple)
    if listed:
        scores = pool_masked(scores, *pool, n_visible)
    else:
        scores = unseen_masked(scores, n_visible)
        if plan.candidate_source is not None:
            scores = scores.masked_fill(~pool, float("-inf"))
    made = None
    if plan.is_candidate_source:
        made = make_pool(scores, n_visible, config.candidate_topk_blocks, config.candidate_block_size)
    top, values = top_k(scores, k)
    return Selection(pool[0].gather(-1, top) if listed else top, values > float("-inf"), made)
