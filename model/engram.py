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
4. **Fetch** those rows (:meth:`EngramGate.lookup`; the serving system may fetch them
   remotely instead and hand them in).
5. **Gate and write** (:meth:`EngramGate.forward`): one key per stream plus a shared
   value from the rows; ``out = h + sigmoid(signed_sqrt(<h, key>_normalised)) * value``.

Everything here is pure math.  The hasher keeps no history of its own: incremental
callers (prefill in chunks, then decode one token at a time) carry an explicit
:class:`NgramContext` -- the last ``N - 1`` compressed ids of each sequence -- which
:meth:`NgramHasher.hash_ids` accepts and returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DEAD",
    "EngramGate",
    "EngramLayout",
    "NgramContext",
    "NgramHasher",
    "build_token_map",
    "find_primes",
    "hash_multipliers",
    "multiplier_bound",
]

# Marker for a look-back slot that an n-gram cannot use: before the start of the
# text, or an image token.  Compressed ids are >= 0, so -1 never collides.
DEAD = -1

# The UE8M0-style scales of FP8 Engram rows cover this many channels each.
SCALE_BLOCK = 32

# Clamp of |dot| before the signed square root of the gate (the training kernel's).
GATE_CLAMP = 1e-6


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
# 2. Layout: primes, offsets, multipliers
# ---------------------------------------------------------------------------------

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin; exact for every n < 3.3e24 (these bases)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def find_primes(
    vocab_size: int, n_layers: int, max_ngram_size: int, n_heads: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Bucket primes as ``[layer][ngram_size - 2][head]``.

    For every layer, every n-gram size and every head, the next prime is searched
    upward, strictly above ``vocab_size - 1`` (the search restarts there for each
    n-gram size) and skipping every prime already taken anywhere in the layout.
    """
    taken: set[int] = set()
    layers = []
    for _ in range(n_layers):
        per_ngram = []
        for _ in range(max_ngram_size - 1):
            heads, candidate = [], vocab_size - 1
            for _ in range(n_heads):
                candidate += 1
                while candidate in taken or not _is_prime(candidate):
                    candidate += 1
                taken.add(candidate)
                heads.append(candidate)
            per_ngram.append(tuple(heads))
        layers.append(tuple(per_ngram))
    return tuple(layers)


def hash_multipliers(
    layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """``[layer][k]``: the odd multiplier of the k-th look-back (k = 0 is the current
    token).  Drawn from ``numpy.random.default_rng(10007 * layer_id)`` below
    ``bound = (int64 max // compressed_vocab_size) // 2`` and mapped to ``2 v + 1``,
    so ``compressed id * multiplier`` can never overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(10007 * int(layer_id))
        draws = rng.integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
        rows.append(tuple(int(v) * 2 + 1 for v in draws))
    return tuple(rows)


def multiplier_bound(compressed_vocab_size: int) -> int:
    """Exclusive upper bound of the raw draws behind :func:`hash_multipliers`."""
    return max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)


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


def _config_value(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        if name not in config and isinstance(config.get("text_config"), Mapping):
            return config["text_config"][name]
        return config[name]
    if not hasattr(config, name) and hasattr(config, "text_config"):
        return _config_value(config.text_config, name)
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
        values = {name: _config_value(config, name) for name in _CONFIG_FIELDS}
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


# ---------------------------------------------------------------------------------
# 4. The gate
# ---------------------------------------------------------------------------------


class EngramEmbedding(nn.Module):
    """One Engram table: ``weight [rows, head_dim]`` and ``scale [rows, head_dim // 32]``.

    When the weight is stored as ``float8_e4m3fn`` a looked-up row is dequantised by
    its per-32-channel power-of-two scales; in a float dtype the weight holds the
    dequantised values already and the scales are unused. The scale has
    ``head_dim // 32`` columns whatever the width, as the release sizes it: none for a
    table narrower than 32 (such a table is only ever stored in a float dtype).
    """

    def __init__(self, num_embeddings: int, head_dim: int, device=None, dtype=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.head_dim = head_dim
        self.block = SCALE_BLOCK
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_embeddings, head_dim, **factory))
        self.scale = nn.Parameter(torch.ones(num_embeddings, head_dim // SCALE_BLOCK, **factory))

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(row_ids, self.weight)
        if self.weight.dtype == torch.float8_e4m3fn:
            if self.head_dim % self.block:
                raise ValueError(f"an FP8 Engram table needs a multiple of {self.block} channels, not {self.head_dim}")
            scales = F.embedding(row_ids, self.scale).float()
            rows = (rows.float().unflatten(-1, (-1, self.block)) * scales.unsqueeze(-1)).flatten(-2)
        return rows


class EngramGate(nn.Module):
    """The Engram write before one layer.

    Parameter names follow the checkpoint (``model.layers.{i}.engram.*``)::

        embed.weight [rows, head_dim]           embed.scale [rows, head_dim // 32]
        wkv.weight   [(hc + 1) * hidden, n_cols * head_dim]
        q_weight     [hc, hidden]               k_weight    [hc, hidden]

    ``lookup(row_ids)`` fetches the rows; ``forward(streams, rows, token_mask)`` gates
    them into the streams.  The two are separate so a remote table service can do the
    fetch.
    """

    def __init__(
        self,
        num_embeddings: int,
        head_dim: int,
        n_cols: int,
        hidden_size: int,
        hc_mult: int,
        eps: float,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.n_cols = n_cols
        self.head_dim = head_dim
        self.hidden_size = hidden_size
        self.hc_mult = hc_mult
        self.eps = eps
        factory = {"device": device, "dtype": dtype}
        self.embed = EngramEmbedding(num_embeddings, head_dim, **factory)
        self.wkv = nn.Linear(n_cols * head_dim, (hc_mult + 1) * hidden_size, bias=False, **factory)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, **factory))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, **factory))

    @classmethod
    def from_config(cls, config: Any, layer_id: int, device=None, dtype=None) -> "EngramGate":
        """The gate of model layer ``layer_id`` (must be one of ``engram_layer_ids``).
        Needs ``hidden_size``, ``hc_mult`` and ``rms_norm_eps`` besides the Engram fields."""
        layer_ids = [int(i) for i in _config_value(config, "engram_layer_ids")]
        if layer_id not in layer_ids:
            raise ValueError(f"layer {layer_id} is not an Engram layer ({layer_ids})")
        index = layer_ids.index(layer_id)
        return cls(
            num_embeddings=int(_config_value(config, "engram_num_embeddings")[index]),
            head_dim=int(_config_value(config, "engram_head_dim")),
            n_cols=(int(_config_value(config, "engram_max_ngram_size")) - 1) * int(_config_value(config, "engram_n_heads")),
            hidden_size=int(_config_value(config, "hidden_size")),
            hc_mult=int(_config_value(config, "hc_mult")),
            eps=float(_config_value(config, "rms_norm_eps")),
            device=device,
            dtype=dtype,
        )

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        """``row_ids [B, S, n_cols]`` (one layer's slice of the hasher output) ->
        ``rows [B, S, n_cols, head_dim]`` float32."""
        return self.embed(row_ids).float()

    def gate(self, streams: torch.Tensor, rows: torch.Tensor, token_mask: torch.Tensor | None = None):
        """``(gate [B, S, hc], value [B, S, D])`` in float32."""
        weight = self.wkv.weight
        kv = F.linear(rows.flatten(-2).to(weight.dtype), weight).float()
        key, value = kv.split([self.hc_mult * self.hidden_size, self.hidden_size], dim=-1)
        key = key.unflatten(-1, (self.hc_mult, self.hidden_size))
        h = streams.float()
        qk = self.q_weight.float() * self.k_weight.float()
        # Normalised per (token, stream) over D, both the stream and its key.
        inv = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * qk * key).sum(-1) * inv / self.hidden_size**0.5
        # Signed square root (copysign: +0 counts as positive), then the sigmoid.
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.bool().unsqueeze(-1), 0.0)
        return gate, value

    def forward(
        self, streams: torch.Tensor, rows: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """streams ``[B, S, hc, D]``; rows ``[B, S, n_cols, head_dim]`` from
        :meth:`lookup` (integer row ids ``[B, S, n_cols]`` are looked up here);
        token_mask ``[B, S]``, False shuts the gate (image tokens, padding).
        Returns ``streams + gate * value`` in the dtype of ``streams``."""
        if not rows.is_floating_point():
            rows = self.lookup(rows)
        gate, value = self.gate(streams, rows, token_mask)
        out = streams.float() + gate.unsqueeze(-1) * value.unsqueeze(-2)
        return out.to(streams.dtype)
