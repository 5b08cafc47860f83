"""Engram: the n-gram hash memory written into the mHC streams at a few layers.

The pipeline, per token (seed: "Engram: a memory you look up"; numerics from the
released reference):

1. **Normalise** the token id through a fixed table (:func:`build_token_map`) that
   merges ids whose text is the same after NFKC/NFD, accent removal, lowercasing and
   whitespace collapsing.
2. **N-grams**: the current compressed id and up to ``N - 1`` before it.  Look-back
   stops at the start of the text and at an image token; the slots it cannot reach
   hold the compressed pad id.
3. **Hash**: per Engram layer, ``x_k = id_k * multiplier_k`` (``k = 0`` is the current
   token, ``k = 1`` the one before, ...).  The running XOR ``x_0 ^ x_1 ^ ... ^ x_{n-1}``
   is the hash of the n-gram of size ``n``; for every head it is reduced modulo that
   (n-gram, head) pair's own prime and shifted by the pair's offset in the layer's
   table.  ``(N - 1) * heads`` row ids per token and layer.
4. **Fetch** those rows (:meth:`model.engram_gate.EngramGate.lookup`; the serving
   system may fetch them remotely instead and hand them in).
5. **Gate and write** (:meth:`model.engram_gate.EngramGate.forward`): one key per
   stream plus a shared value from the rows;
   ``out = h + sigmoid(signed_sqrt(<h, key>_normalised)) * value``.

Steps 1 to 3 live here, the primes and multipliers of step 3 in
:mod:`model.engram_primes`, steps 4 and 5 in :mod:`model.engram_gate`. Everything is
pure math.  The hasher keeps no history of its own: incremental
callers (prefill in chunks, then decode one token at a time) carry an explicit
:class:`NgramContext` -- the last ``N - 1`` compressed ids of each sequence -- which
:meth:`NgramHasher.hash_ids` accepts and returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .engram_primes import find_primes, hash_multipliers

__all__ = [
    "DEAD",
    "EngramLayout",
    "NgramContext",
    "NgramHasher",
    "build_token_map",
    "config_value",
]

# Marker for a look-back slot that an n-gram cannot use: before the start of the
# text, or an image token.  Compressed ids are >= 0, so -1 never collides.
DEAD = -1


# ---------------------------------------------------------------------------------
# 1. Token normalisation map
# ---------------------------------------------------------------------------------

# A private-use code point stands in for a token that is exactly one space while the
# surrounding whitespace is stripped, so " " keeps its own id instead of collapsing to
# the empty string.  It is turned back into a space afterwards (everywhere, as the
# released map does).
_SPACE_SENTINEL = "\ue000"


def _engram_normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def build_token_map(tokenizer: Any) -> tuple[list[int], int]:
    """The Engram token map: ``token_map[token_id] -> compressed id``, and the number
    of compressed ids.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (an object with a ``backend_tokenizer``
    attribute, like a transformers fast tokenizer, is unwrapped).  Every id, added and
    special tokens included, is decoded on its own; its text is normalised (NFKC, NFD,
    accents stripped, lowercased, runs of space/tab/CR/LF collapsed to one space,
    surrounding whitespace stripped -- except that a token which is exactly one space
    stays one space).  Ids with the same normalised text share a compressed id,
    numbered in order of first appearance.  A token whose text is empty after
    normalisation keeps its raw decoded text as its key.  A token that decodes to a
    partial UTF-8 sequence (its text contains U+FFFD) is keyed by its raw vocabulary
    string, so distinct byte fragments stay distinct.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    normalizer = _engram_normalizer()
    vocab_size = backend.get_vocab_size(with_added_tokens=True)

    ids_by_key: dict[str, int] = {}
    token_map: list[int] = []
    for token_id in range(vocab_size):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map.append(ids_by_key.setdefault(key, len(ids_by_key)))
    return token_map, len(ids_by_key)


# ---------------------------------------------------------------------------------
# 2. Layout: primes (model/engram_primes.py), offsets, multipliers
# ---------------------------------------------------------------------------------

_CONFIG_FIELDS = (
    "engram_layer_ids",
    "engram_vocab_size",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_num_embeddings",
    "engram_compressed_vocab_size",
    "engram_pad_id",
)


def config_value(config: Any, name: str) -> Any:
    """An Engram field of a config object or mapping (or of its ``text_config``)."""
    if isinstance(config, Mapping):
        if name not in config and isinstance(config.get("text_config"), Mapping):
            return config["text_config"][name]
        return config[name]
    if not hasattr(config, name) and hasattr(config, "text_config"):
        return config_value(config.text_config, name)
    return getattr(config, name)


@dataclass(frozen=True)
class EngramLayout:
    """The hash layout of all Engram layers (a pure function of the config).

    ``primes[l][n - 2][h]`` is the bucket count of n-gram size ``n`` / head ``h`` in
    layer ``l`` (index into ``layer_ids``); the layer's table stacks those buckets in
    the flat (n-gram, head) order, starting at ``offsets[l][col]``, and has
    ``num_embeddings[l] = sum(primes[l])`` rows.  ``multipliers[l][k]`` weighs the
    k-th look-back token.
    """

    layer_ids: tuple[int, ...]
    vocab_size: int
    max_ngram_size: int
    n_heads: int
    head_dim: int
    num_embeddings: tuple[int, ...]
    compressed_vocab_size: int
    pad_id: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]

    @classmethod
    def from_config(cls, config: Any) -> "EngramLayout":
        """Build from any object (or mapping) with the ``engram_*`` fields; a nested
        ``text_config`` is looked into when the fields are not at the top level."""
        values = {name: config_value(config, name) for name in _CONFIG_FIELDS}
        layer_ids = tuple(int(i) for i in values["engram_layer_ids"])
        n = int(values["engram_max_ngram_size"])
        heads = int(values["engram_n_heads"])
        cvs = int(values["engram_compressed_vocab_size"])
        primes = find_primes(int(values["engram_vocab_size"]), len(layer_ids), n, heads)
        offsets = []
        for layer in primes:
            row, total = [], 0
            for p in (p for per_ngram in layer for p in per_ngram):
                row.append(total)
                total += p
            offsets.append(tuple(row))
        return cls(
            layer_ids=layer_ids,
            vocab_size=int(values["engram_vocab_size"]),
            max_ngram_size=n,
            n_heads=heads,
            head_dim=int(values["engram_head_dim"]),
            num_embeddings=tuple(int(v) for v in values["engram_num_embeddings"]),
            compressed_vocab_size=cvs,
            pad_id=int(values["engram_pad_id"]),
            primes=primes,
            offsets=tuple(offsets),
            multipliers=hash_multipliers(layer_ids, n, cvs),
        )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` unless the layout is consistent; in particular each
        layer's primes must add up to its configured ``num_embeddings`` exactly (a
        mismatch means a different prime search than the checkpoint was trained with,
        and every row id would point at the wrong row)."""
        if self.max_ngram_size < 2:
            raise ValueError(f"engram_max_ngram_size must be >= 2, got {self.max_ngram_size}")
        if self.n_heads < 1 or self.head_dim < 1:
            raise ValueError(f"engram_n_heads and engram_head_dim must be >= 1, got {self.n_heads}, {self.head_dim}")
        if self.compressed_vocab_size < 1:
            raise ValueError(f"engram_compressed_vocab_size must be >= 1, got {self.compressed_vocab_size}")
        n_layers = len(self.layer_ids)
        if len(set(self.layer_ids)) != n_layers:
            raise ValueError(f"engram_layer_ids has duplicates: {list(self.layer_ids)}")
        if len(self.num_embeddings) != n_layers:
            raise ValueError(
                f"engram_num_embeddings has {len(self.num_embeddings)} entries for "
                f"{n_layers} Engram layers {list(self.layer_ids)}"
            )
        for name, table in (("primes", self.primes), ("offsets", self.offsets), ("multipliers", self.multipliers)):
            if len(table) != n_layers:
                raise ValueError(f"EngramLayout.{name} has {len(table)} layers, expected {n_layers}")
        for l, layer_id in enumerate(self.layer_ids):
            flat = [p for per_ngram in self.primes[l] for p in per_ngram]
            if len(self.primes[l]) != self.max_ngram_size - 1 or len(flat) != self.n_cols:
                raise ValueError(f"EngramLayout.primes of layer {layer_id} is not [{self.max_ngram_size - 1}][{self.n_heads}]")
            if sum(flat) != self.num_embeddings[l]:
                raise ValueError(
                    f"Engram layer {layer_id}: the hash primes (searched upward from "
                    f"engram_vocab_size - 1 = {self.vocab_size - 1}) sum to {sum(flat)}, but "
                    f"engram_num_embeddings[{l}] = {self.num_embeddings[l]}; the config's "
                    "engram_vocab_size / engram_max_ngram_size / engram_n_heads / "
                    "engram_layer_ids do not describe this table"
                )
            if len(self.offsets[l]) != self.n_cols or len(self.multipliers[l]) != self.max_ngram_size:
                raise ValueError(f"EngramLayout offsets/multipliers of layer {layer_id} have the wrong length")
        if not 0 <= self.pad_id:
            raise ValueError(f"engram_pad_id must be a token id, got {self.pad_id}")

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_cols(self) -> int:
        """Row ids per token and layer: ``(N - 1) * heads``."""
        return (self.max_ngram_size - 1) * self.n_heads


# ---------------------------------------------------------------------------------
# 3. N-gram hashing
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class NgramContext:
    """The look-back of a batch of sequences: ``tail[b]`` holds the compressed ids of
    the last ``N - 1`` tokens of sequence ``b``, oldest first, with :data:`DEAD` where
    there is no usable token (before the start of the text, or an image token).

    A value object: :meth:`NgramHasher.hash_ids` returns a new one and never changes
    the one it is given.
    """

    tail: torch.Tensor  # [B, N - 1] int64

    @classmethod
    def empty(cls, batch: int, max_ngram_size: int, device: torch.device | str | None = None) -> "NgramContext":
        """The context at the start of a text: every look-back slot DEAD."""
        return cls(torch.full((batch, max_ngram_size - 1), DEAD, dtype=torch.long, device=device))

    @property
    def batch(self) -> int:
        return self.tail.shape[0]

    def select(self, index: int | Sequence[int] | torch.Tensor) -> "NgramContext":
        """The contexts of some sequences of the batch (an int keeps a batch of 1)."""
        if isinstance(index, int):
            return NgramContext(self.tail[index : index + 1].clone())
        return NgramContext(self.tail[torch.as_tensor(index, dtype=torch.long, device=self.tail.device)].clone())

    @staticmethod
    def cat(contexts: Sequence["NgramContext"]) -> "NgramContext":
        """Concatenate the batches of several contexts (e.g. to form a decode batch)."""
        return NgramContext(torch.cat([c.tail for c in contexts], dim=0))

    def to(self, device: torch.device | str) -> "NgramContext":
        return NgramContext(self.tail.to(device))


class NgramHasher:
    """Row ids of every Engram layer for every token, from token ids alone.

    Holds only constants (token map, primes, offsets, multipliers); the history of a
    sequence lives in the :class:`NgramContext` that the caller passes and gets back.
    """

    def __init__(self, layout: EngramLayout, token_map: Sequence[int] | torch.Tensor):
        token_map = torch.as_tensor(token_map, dtype=torch.long).clone()
        if token_map.dim() != 1 or token_map.numel() == 0:
            raise ValueError("token_map must be a non-empty 1-D sequence of compressed ids")
        n_compressed = int(token_map.max()) + 1
        if n_compressed != layout.compressed_vocab_size or int(token_map.min()) < 0:
            raise ValueError(
                f"the token map has {n_compressed} compressed ids but engram_compressed_vocab_size = "
                f"{layout.compressed_vocab_size}; the hash multipliers derive from it, so the "
                "whole Engram table would be addressed wrongly (wrong tokenizer?)"
            )
        if layout.pad_id >= token_map.numel():
            raise ValueError(f"engram_pad_id {layout.pad_id} is outside the token map ({token_map.numel()} ids)")
        self.layout = layout
        self.token_map = token_map
        self.pad_id = int(token_map[layout.pad_id])
        self.multipliers = torch.tensor(layout.multipliers, dtype=torch.long)  # [L, N]
        # [L, N-1, heads]: primes of each n-gram size, and the table offsets alike.
        self.primes = torch.tensor(layout.primes, dtype=torch.long)
        self.offsets = torch.tensor(layout.offsets, dtype=torch.long).view_as(self.primes)

    @classmethod
    def from_tokenizer(cls, layout: EngramLayout, tokenizer: Any) -> "NgramHasher":
        token_map, _ = build_token_map(tokenizer)
        return cls(layout, token_map)

    @property
    def max_ngram_size(self) -> int:
        return self.layout.max_ngram_size

    def empty_context(self, batch: int, device: torch.device | str | None = None) -> NgramContext:
        return NgramContext.empty(batch, self.max_ngram_size, device)

    def compress(self, token_ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Compressed ids, :data:`DEAD` where ``token_mask`` is False."""
        ids = self.token_map.to(token_ids.device)[token_ids.long()]
        if token_mask is not None:
            ids = ids.masked_fill(~token_mask.bool(), DEAD)
        return ids

    def hash_ids(
        self,
        token_ids: torch.Tensor,
        context: NgramContext | None = None,
        token_mask: torch.Tensor | None = None,
        lengths: torch.Tensor | Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, NgramContext]:
        """Hash the n-grams ending at each token.

        token_ids: ``[B, S]`` (a 1-D ``[S]`` is treated as a batch of one).
        context: the look-back before ``token_ids[:, 0]``; ``None`` = start of the text.
        token_mask: ``[B, S]`` bool, False at image tokens (and at padding).  A masked
            token's own slots and every look-back through it hold the pad id.
        lengths: ``[B]`` number of real tokens per row when rows are right-padded; the
            returned context then ends at each row's last real token.  Default: ``S``.

        Returns ``(row_ids [B, S, n_layers, (N-1)*heads] int64, context after)``.
        Hashing a text in pieces, threading the context through, gives exactly the
        ids of hashing it in one go.
        """
        squeeze = token_ids.dim() == 1
        if squeeze:
            token_ids = token_ids.unsqueeze(0)
            token_mask = None if token_mask is None else token_mask.unsqueeze(0)
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must be [B, S], got shape {tuple(token_ids.shape)}")
        batch, seq = token_ids.shape
        device = token_ids.device
        back = self.max_ngram_size - 1
        if context is None:
            context = self.empty_context(batch, device)
        if context.tail.shape != (batch, back):
            raise ValueError(f"context is {tuple(context.tail.shape)}, expected ({batch}, {back})")

        window = torch.cat([context.tail.to(device), self.compress(token_ids, token_mask)], dim=1)  # [B, back+S]

        # Look-back k of token s sits at window[:, back + s - k]; once a DEAD slot is
        # met, it and every older slot take the pad id.
        blocked = torch.zeros(batch, seq, dtype=torch.bool, device=device)
        grams = []
        for k in range(self.max_ngram_size):
            source = window[:, back - k : back - k + seq]
            blocked = blocked | (source == DEAD)
            grams.append(source.masked_fill(blocked, self.pad_id))
        grams = torch.stack(grams, dim=-1)  # [B, S, N]

        multipliers = self.multipliers.to(device)
        primes = self.primes.to(device)
        offsets = self.offsets.to(device)
        products = grams.unsqueeze(2) * multipliers  # [B, S, L, N]
        running = products[..., 0]
        cols = []
        for k in range(1, self.max_ngram_size):
            running = running ^ products[..., k]
            # n-gram size k+1: one bucket per head, [B, S, L, heads]
            cols.append(running.unsqueeze(-1) % primes[:, k - 1] + offsets[:, k - 1])
        row_ids = torch.cat(cols, dim=-1)  # [B, S, L, (N-1)*heads]

        if lengths is None:
            tail = window[:, seq : seq + back]
        else:
            ends = torch.as_tensor(lengths, dtype=torch.long, device=device).view(batch, 1)
            if bool(((ends < 0) | (ends > seq)).any()):
                raise ValueError(f"lengths must lie in [0, {seq}], got {ends.view(-1).tolist()}")
            tail = window.gather(1, ends + torch.arange(back, device=device))
        new_context = NgramContext(tail.clone())

        if squeeze:
            row_ids = row_ids.squeeze(0)
        return row_ids, new_context

    __call__ = hash_ids
