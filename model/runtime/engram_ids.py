"""Which Engram table rows a step's tokens read: their hashed n-gram row ids, and the
rows of the model's in-process tables for them.

The engine hashes every new token once, from its sequence's n-gram context (which it
advances), and no n-gram reaches across an image position. A step of several
sequences is hashed in one call over the right-padded batch. The rows themselves come
from the model's tables here, or from a remote table service (the prefill's
``engram_rows`` thunk, :meth:`model.runtime.engine.Engine.prefill`).
"""

from __future__ import annotations

import torch

from ..engram import NgramContext, NgramHasher
from ..transformer import Transformer
from .cache import SequenceCache


class EngramIds:
    """Row ids of new tokens and their rows for one model (no Engram: ``hasher`` None,
    and every method gives None or no rows). ``image_token_id``: the id that marks
    image positions (None: a model without images)."""

    def __init__(self, model: Transformer, hasher: NgramHasher | None, image_token_id: int | None) -> None:
        self.model, self.hasher, self.image_token_id = model, hasher, image_token_id

    def image_mask(self, ids: torch.Tensor) -> torch.Tensor | None:
        """True at image positions of ``ids`` [n]; None when there are none."""
        if self.image_token_id is None:
            return None
        mask = ids == self.image_token_id
        return mask if bool(mask.any()) else None

    def of_new(self, cache: SequenceCache, ids: torch.Tensor, image_mask: torch.Tensor | None = None
               ) -> torch.Tensor | None:
        """Row ids [1, n, layers, cols] of a sequence's new tokens ``ids`` [n];
        advances its n-gram context."""
        if self.hasher is None:
            return None
        hash_ids, cache.ngram = self._hash(ids, cache.ngram, image_mask)
        return hash_ids

    def of_step(self, caches: list[SequenceCache], ids: list[torch.Tensor]) -> torch.Tensor | None:
        """Row ids [1, N, layers, cols] of a step's new tokens, ``ids`` [n_i] per
        sequence, flat in batch order: one hasher call over the right-padded batch
        (padding only follows each sequence's tokens, so it enters no n-gram of
        theirs); advances each sequence's n-gram context."""
        if self.hasher is None or len(ids) == 1:
            return self.of_new(caches[0], ids[0])
        device = ids[0].device
        lengths = [len(t) for t in ids]
        context = NgramContext.cat([self.hasher.empty_context(1, device) if c.ngram is None else c.ngram
                                    for c in caches])
        padded = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)
        row_ids, after = self.hasher.hash_ids(padded, context, lengths=lengths)
        for index, cache in enumerate(caches):
            cache.ngram = after.select(index)
        if min(lengths) == max(lengths):
            return row_ids.flatten(0, 1)[None]
        real = torch.arange(padded.shape[1], device=device) < torch.tensor(lengths, device=device)[:, None]
        return row_ids[real][None]

    def of_tail(self, token_ids: list[int], start: int) -> torch.Tensor | None:
        """Row ids [1, n, layers, cols] of tokens ``start..`` of ``token_ids``, with
        their true n-gram look-back."""
        if self.hasher is None:
            return None
        back = max(0, start - (self.hasher.max_ngram_size - 1))
        ids = self._tensor(token_ids[back:])
        return self._hash(ids, None, self.image_mask(ids))[0][:, start - back :]

    def context_after(self, token_ids: list[int]) -> NgramContext | None:
        """The n-gram context after ``token_ids``; None without Engram."""
        if self.hasher is None:
            return None
        ids = self._tensor(token_ids)
        return self._hash(ids, None, self.image_mask(ids))[1]

    def rows(self, hash_ids: torch.Tensor | None, layers: tuple[int, ...] | None = None) -> dict[int, torch.Tensor]:
        """Rows [n, cols, hd] per Engram layer (``layers``, default all) from the model's
        in-process tables, for row ids [1, n, layers, cols]."""
        if hash_ids is None:
            return {}
        return {layer: rows[0] for layer, rows in self.model.engram_rows(hash_ids, layers).items()}

    def _hash(self, ids: torch.Tensor, context: NgramContext | None,
              image_mask: torch.Tensor | None) -> tuple[torch.Tensor, NgramContext]:
        """The hasher over ``ids`` [n] from ``context``, no n-gram across an image
        position (``image_mask``; None: there are none)."""
        return self.hasher.hash_ids(ids[None], context, token_mask=None if image_mask is None else ~image_mask[None])

    def _tensor(self, token_ids: list[int]) -> torch.Tensor:
        return torch.tensor(token_ids, dtype=torch.long, device=self.model.embed.weight.device)
