"""What the engine takes in besides token ids and caches.

:class:`DecoderInput` is what a prefill hands the decoder (the prefill pool's output,
the decoder pool's input: pickled between replicas); :class:`ImageSpan` is an image of
a prompt, its embeddings made only when the engine encodes its positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class DecoderInput:
    """The decoder-input streams of the tokens the decoder will (re)play.

    ``positions`` [n] absolute, ``streams`` [n, hc, D] and ``pre`` [n, hc] are the
    encoder's output (the mHC streams after the last encoder layer and the mix its
    last site chose), ``token_ids`` [n] the tokens; ``engram_ids`` [n, layers, cols]
    their Engram row ids (hashed with their true look-back, which a replay of the
    tail alone could not see), for Engram layers in the decoder half; ``None`` when
    the model has no Engram layers.
    """

    positions: torch.Tensor
    streams: torch.Tensor
    pre: torch.Tensor
    token_ids: torch.Tensor
    engram_ids: torch.Tensor | None = None

    def tail(self, n: int) -> "DecoderInput":
        return DecoderInput(*(None if t is None else t[-n:] for t in self._fields()))

    def compact(self) -> "DecoderInput":
        """The same inputs in tensors of their own size: a :meth:`tail` is a view, and a
        pickled view carries all of the storage under it."""
        return DecoderInput(*(None if t is None else t.clone() for t in self._fields()))

    def then(self, later: "DecoderInput") -> "DecoderInput":
        """These tokens followed by ``later`` ones (e.g. a restored tail, then a new turn)."""
        if int(self.positions[-1]) + 1 != int(later.positions[0]):
            raise ValueError("decoder inputs are not contiguous")
        if (self.engram_ids is None) != (later.engram_ids is None):
            raise ValueError("decoder inputs disagree on Engram row ids")
        return DecoderInput(*(None if a is None else torch.cat((a, b))
                              for a, b in zip(self._fields(), later._fields())))

    def _fields(self) -> tuple:
        return self.positions, self.streams, self.pre, self.token_ids, self.engram_ids


@dataclass(frozen=True)
class ImageSpan:
    """An image in a prompt: its span (start marker, rows of image tokens each ended by
    a newline marker, end marker) at absolute positions ``start .. start + length``,
    every one holding the model's image token id. ``embed()`` returns the span's input
    embeddings [length, D] (the vision tower's output); the engine calls it only when
    it encodes some of the span's positions, so a span read from the store costs no
    tower run."""

    start: int
    length: int
    embed: Callable[[], torch.Tensor]
