"""The decoder pool: replay, continuous-batching decode, write the conversation back.

:class:`DecoderService` is the engine-side logic (tested without Ray): it admits
handoffs from the prefill pool into a :class:`model.batcher.Batcher`, steps the
batch, and when a request ends normally writes the conversation's new whole chunks
and its window state to the node's store. A request that fails or is cancelled
writes nothing, so the store never holds a partial conversation. Writes are
deferred to :meth:`DecoderService.write_pending`, which the replica runs after the
tokens went out, so serialising a conversation never delays its last token.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

from model.batcher import Batcher, Speculation, TokenEvent
from model.cache import SequenceCache
from model.chat import Tokenizer
from model.engine import DecoderInput, Engine
from model.sampling import SamplingParams
from model.serialize import chunk_to_bytes, load_chunks, load_window, window_to_bytes

from .prefill import StoreLike, read_through
from .state import Handoff, StateNaming


class PrefixUnavailable(RuntimeError):
    """The stored prefix a handoff names is in neither this node's store nor the one
    that served it to the prefill (evicted in between)."""


class DecoderService:
    """One decoder replica's batch, and its writes to the store."""

    def __init__(self, engine: Engine, store: StoreLike, naming: StateNaming, tokenizer: Tokenizer | None = None,
                 eos_token_ids: tuple[int, ...] = (), max_batch: int = 32, speculation: Speculation | None = None,
                 peers: Callable[[str], StoreLike | None] | None = None):
        """``peers(node_id)``: another node's store (None if it has none), for a prefix
        this node does not hold."""
        self.engine, self.store, self.naming, self.peers = engine, store, naming, peers
        self.batcher = Batcher(engine, tokenizer, eos_token_ids, max_batch, on_finish=self._finished,
                               speculation=speculation)
        self._requests: dict[str, Handoff] = {}
        self._pending: list[tuple[Handoff, SequenceCache, list[int]]] = []
        self.last_admit_s = 0.0

    def admit(self, request_id: str, handoff: Handoff, params: SamplingParams) -> TokenEvent:
        """Load a handoff, replay the decoder half, and return the first token."""
        cache = handoff.cache
        if cache is None:
            cache = self._load_prefix(handoff)
            load_window(cache, handoff.state, self.naming.identity)
        inputs = DecoderInput(handoff.positions, handoff.streams, handoff.pre, handoff.replay_ids,
                              handoff.replay_engram_ids)
        self._requests[request_id] = dataclasses.replace(handoff, cache=None)
        start = time.perf_counter()
        try:
            return self.batcher.add(request_id, params, cache=cache, inputs=inputs)
        finally:
            self.last_admit_s = time.perf_counter() - start
            if request_id not in self.batcher.running:
                self._requests.pop(request_id, None)

    def _load_prefix(self, handoff: Handoff) -> SequenceCache:
        """A cache holding the stored chunks the handoff names: from this node's store,
        else from the node that served them (and kept here for the next turn)."""
        cache = self.engine.new_cache()
        keys = list(handoff.chunk_keys[: handoff.stored_chunks])
        if not keys:
            return cache
        blobs = read_through(self.store, self.peers, keys, [handoff.prefix_node])
        loaded = load_chunks(cache, itertools.takewhile(bool, blobs), self.naming.identity)
        if loaded < len(keys):
            raise PrefixUnavailable(f"{len(keys) - loaded} of the {len(keys)} stored chunks of the prompt are gone "
                                    f"from this node's store and node {handoff.prefix_node}'s")
        return cache

    def step(self) -> list[TokenEvent]:
        """One batch step: one token per request, or several with speculation."""
        return self.batcher.step()

    @property
    def spec_metrics(self):
        """The batcher's :class:`model.speculative.SpecMetrics` (None without speculation)."""
        return self.batcher.metrics if self.batcher.speculation is not None else None

    def cancel(self, request_id: str) -> None:
        self.batcher.cancel(request_id)
        self._requests.pop(request_id, None)

    @property
    def running(self) -> int:
        return len(self.batcher.running)

    def _finished(self, request_id: str, cache: SequenceCache, generated: list[int]) -> None:
        handoff = self._requests.pop(request_id, None)
        if handoff is not None:
            self._pending.append((handoff, cache, generated))

    def write_pending(self) -> None:
        """Store every finished conversation's new whole chunks and window state."""
        pending, self._pending = self._pending, []
        for handoff, cache, generated in pending:
            self._write_back(handoff, cache, generated)

    def _write_back(self, handoff: Handoff, cache: SequenceCache, generated: list[int]) -> None:
        tokens = list(handoff.token_ids) + generated[:-1]  # the last token was never fed
        if len(tokens) != cache.length:
            raise RuntimeError(f"cache holds {cache.length} tokens, the conversation {len(tokens)}")
        size = self.naming.chunk_tokens
        whole = cache.length // size
        keys = self.naming.chunks(tokens, known=handoff.chunk_keys)
        for index in range(handoff.stored_chunks, whole):
            self.store.put(keys[index], chunk_to_bytes(cache, index * size, size, self.naming.identity))
        window = self.naming.window(tokens, known=tuple(keys))
        self.store.put(window, window_to_bytes(cache, whole * size, self.naming.identity))
