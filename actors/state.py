"""What crosses between the pools: cache plans, prefill handoffs, and the store's naming.

The router builds a :class:`CachePlan` for each request (which chunks of the prompt
are stored, and where); a prefill replica turns it into a :class:`Handoff` for a
decoder replica; the decoder writes the conversation back to the store under the
same names. Naming lives in :class:`StateNaming`: one model fingerprint, one chunk
length, for every actor of a deployment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.runtime.cache import SequenceCache
from model.runtime.serialize import StateIdentity, chunk_granularity
from storage.keys import (NO_SCOPE, Fingerprint, KeyScope, MediaSpan, ObjectKey, chunk_keys, window_key,
                          window_keys_after)


@dataclass(frozen=True)
class StateNaming:
    """Names of a model's stored state: the store fingerprint and the chunk length. Each
    name is in a request's :class:`~storage.keys.KeyScope` (its tenant's)."""

    fingerprint: Fingerprint
    identity: StateIdentity
    chunk_tokens: int

    @classmethod
    def of(cls, identity: StateIdentity, config, chunk_tokens: int) -> "StateNaming":
        if chunk_tokens % chunk_granularity(config):
            raise ValueError(f"chunk_tokens {chunk_tokens} must be a multiple of {chunk_granularity(config)}")
        return cls(Fingerprint(identity.model), identity, chunk_tokens)

    def chunks(self, token_ids: list[int], known: tuple[ObjectKey, ...] = (),
               media: tuple[MediaSpan, ...] = (), scope: KeyScope = NO_SCOPE) -> list[ObjectKey]:
        """Keys of the whole chunks of ``token_ids``; ``known`` are those of its first
        chunks, already computed (the plan's): only the rest is hashed. ``media``: the
        prompt's images (a chunk holding an image's start hashes its digest)."""
        return chunk_keys(self.fingerprint, token_ids, self.chunk_tokens, media, known=known, scope=scope)

    def loadable_chunks(self, plan: "CachePlan") -> int:
        """How many of a plan's stored chunks a prefill loads: all of them, short of the
        prompt's last token, which must be encoded."""
        return min(plan.cached_chunks, (len(plan.token_ids) - 1) // self.chunk_tokens)

    def window(self, token_ids: list[int], known: tuple[ObjectKey, ...] = (),
               media: tuple[MediaSpan, ...] = (), scope: KeyScope = NO_SCOPE) -> ObjectKey:
        """The name of the window state after all of ``token_ids``."""
        return window_key(self.fingerprint, token_ids, self.chunk_tokens, media, known=known, scope=scope)

    def window_candidates(self, token_ids: list[int], chunked: int, known: tuple[ObjectKey, ...] = (),
                          media: tuple[MediaSpan, ...] = (), scope: KeyScope = NO_SCOPE) -> list[tuple[int, ObjectKey]]:
        """(length, key) of every window state a prompt could resume from after its
        first ``chunked`` tokens (the conversation's previous turn ended somewhere in
        the next chunk), longest first."""
        return window_keys_after(self.fingerprint, token_ids, self.chunk_tokens, chunked, media, known=known,
                                 scope=scope)


@dataclass(frozen=True)
class PromptImage:
    """An image of a prompt: its span starts at position ``start`` and takes ``length``
    positions; ``pixels`` [3, H, W] uint8 RGB as decoded; ``digest`` names its content
    (in the chunk keys: the same image in the same place shares cache, another never)."""

    start: int
    length: int
    pixels: torch.Tensor
    digest: bytes

    @property
    def media(self) -> MediaSpan:
        return MediaSpan(self.start, self.digest)


def media_of(images: tuple[PromptImage, ...]) -> tuple[MediaSpan, ...]:
    return tuple(image.media for image in images)


@dataclass(frozen=True)
class StoringConversation:
    """What a request's last event says of its conversation while the decoder replica
    stores it: the objects' names (new whole chunks, then the window state after all
    ``length`` tokens). The router holds a turn that continues it until it is stored."""

    keys: tuple[ObjectKey, ...]
    length: int

    @property
    def window(self) -> ObjectKey:
        return self.keys[-1]


@dataclass(frozen=True)
class CachePlan:
    """The router's view of a request's stored prefix.

    ``cached_chunks`` leading chunks of ``token_ids`` are stored somewhere in the
    cluster; ``nodes`` are the nodes holding them, best first (RAM beats SSD).
    ``chunk_keys`` names every whole chunk of the prompt, hashed once by the router.
    ``windows``: the window states after those chunks that the index knows of,
    ``(length, key)`` longest first; ``None`` when nobody asked the index (the
    prefill then probes every candidate in its store). ``scope``: the request's tenant's
    (every name of the request's state is in it).
    """

    token_ids: tuple[int, ...]
    cached_chunks: int
    nodes: tuple[str, ...] = ()
    windows: tuple[tuple[int, ObjectKey], ...] | None = None
    chunk_keys: tuple[ObjectKey, ...] | None = None  # every whole chunk of the prompt (None: not computed)
    images: tuple[PromptImage, ...] = ()  # the prompt's images, in order (only a prefill replica encodes them)
    scope: KeyScope = NO_SCOPE

    @property
    def media(self) -> tuple[MediaSpan, ...]:
        return media_of(self.images)


@dataclass
class Handoff:
    """A prefilled request, from a prefill replica to a decoder replica.

    The cache travels in two parts. The prefix the prefill loaded from the store is
    named, not carried: the first ``stored_chunks`` of ``chunk_keys`` (every whole
    chunk of the prompt), which the decoder reads from its own node's store, or from
    ``prefix_node``'s (the node that served them to the prefill). ``state`` is the
    rest, serialized: a window-state object after those chunks (the long-range rows of
    the new tokens, every window, the pending rows, the n-gram context), so its size
    follows the new tokens, not the conversation. The tensors are the decoder input of
    the tokens the decoder must replay. A handoff that never leaves the process it was
    made in (the decoder encoding a short prompt itself) carries the ``cache`` instead
    and an empty ``state``. ``cached_tokens`` counts prompt tokens read from the store
    rather than encoded.
    """

    token_ids: tuple[int, ...]
    state: bytes
    positions: torch.Tensor
    streams: torch.Tensor
    pre: torch.Tensor
    replay_ids: torch.Tensor
    cached_tokens: int
    stored_chunks: int
    prefill_s: float = 0.0  # time the prefill replica spent on it (the Serve-overhead bench)
    moved_bytes: int = 0  # bytes of its cache read from other nodes' stores (prefill and decoder)
    recomputed_tokens: int = 0  # stored tokens encoded again: reading them from their node cost more
    replay_engram_ids: torch.Tensor | None = None  # Engram row ids of the replayed tokens (DecoderInput.engram_ids)
    chunk_keys: tuple[ObjectKey, ...] = ()
    prefix_node: str | None = None
    # Wall-clock marks (time.time()) of the request's trip, set by the replicas it
    # crosses ("prefill_in", "prefill_out", ...): the router's Server-Timing header.
    timeline: dict[str, float] = field(default_factory=dict)
    prefilled_by: str = ""  # "pool" (a prefill replica) or "decoder" (encoded where it decodes)
    cache: SequenceCache | None = None
    media: tuple[MediaSpan, ...] = ()  # the prompt's images (their places and digests: the store's names)
    scope: KeyScope = NO_SCOPE  # the request's tenant's: the decoder stores the conversation under it

    def __getstate__(self):
        if self.cache is not None:
            raise TypeError("a handoff holding its cache stays in the process that made it")
        return self.__dict__
