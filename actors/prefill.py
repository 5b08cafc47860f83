"""The prefill encoder pool: load the stored prefix, encode the new tokens, hand off.

:class:`PrefillService` is the engine-side logic (tested without Ray); the Serve
deployment in :mod:`cluster.app` is a thin wrapper around it.

For a request it (1) reads the stored chunks of the prompt's cached prefix from its
node's store, (2) looks for the window state of the conversation's previous turn
(host RAM, minutes): with it the windows are exact; without it the encoder reruns
the last window of cached tokens (Encoder SWA Bounded Replay), (3) encodes the new
tokens, and (4) returns a :class:`Handoff` with the serialized cache and the
decoder input.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Protocol

import torch

from model.engine import DecoderInput, Engine
from model.serialize import StateError, load_chunks, load_window, window_to_bytes
from storage.keys import ObjectKey

from .state import CachePlan, Handoff, StateNaming


class StoreLike(Protocol):
    """The part of the tiered store the pools use (a TieredStore or a store actor client)."""

    def get_many(self, keys: list[ObjectKey]) -> list[bytes | None]: ...

    def put(self, key: ObjectKey, payload: bytes) -> None: ...


class PrefillService:
    """Turns cache plans into handoffs with one engine and one node store."""

    def __init__(self, engine: Engine, store: StoreLike, naming: StateNaming):
        self.engine, self.store, self.naming = engine, store, naming

    def prefill(self, plan: CachePlan, engram_rows: Callable[[], dict[int, torch.Tensor]] | None = None,
                in_process: bool = False) -> Handoff:
        """Encode a request. ``engram_rows`` (optional) returns the Engram rows of the
        whole prompt [S, cols, hd] per layer, fetched remotely while this runs.
        ``in_process``: the handoff carries the cache itself, not its bytes (for a
        decoder in this process)."""
        tokens = list(plan.token_ids)
        if not tokens:
            raise ValueError("empty prompt")
        start = time.perf_counter()
        cache, chunks_read, resumed = self._load_stored(tokens, plan)
        replay: DecoderInput | None = None
        if not resumed and cache.length:
            replay = self.engine.restore(cache, tokens[: cache.length])
        cached = cache.length
        rows = None
        if engram_rows is not None:  # rows of the whole prompt: keep the new tokens'
            rows = lambda: {layer: r[cached:] for layer, r in engram_rows().items()}  # noqa: E731
        fresh = self.engine.prefill(cache, tokens[cached:], engram_rows=rows)
        inputs = replay.then(fresh) if replay is not None else fresh
        return Handoff(
            token_ids=tuple(tokens),
            state=b"" if in_process else window_to_bytes(cache, 0, self.naming.identity),
            cache=cache if in_process else None,
            positions=inputs.positions,
            streams=inputs.streams,
            pre=inputs.pre,
            replay_ids=inputs.token_ids,
            replay_engram_ids=inputs.engram_ids,
            cached_tokens=cached,
            stored_chunks=chunks_read,
            prefill_s=time.perf_counter() - start,
        )

    def _load_stored(self, tokens: list[int], plan: CachePlan):
        """The longest run of stored chunks that verifies (a bad chunk ends the run),
        then the window state after them if the store has it. One store call when the
        chunks are good; none when the plan says nothing is stored."""
        cache = self.engine.new_cache()
        # Keep one token out of the chunks: the prompt's last token must be encoded.
        usable = min(plan.cached_chunks, (len(tokens) - 1) // self.naming.chunk_tokens)
        keys = self.naming.chunks(tokens)[:usable]
        # The router asked the index for the windows after exactly these chunks.
        windows = list(plan.windows) if plan.windows is not None else self._window_candidates(tokens, usable)
        blobs = self.store.get_many(keys + [key for _, key in windows]) if keys or windows else []
        present = itertools.takewhile(lambda blob: blob is not None, blobs[: len(keys)])
        loaded = load_chunks(cache, present, self.naming.identity)  # up to a missing or bad chunk
        if loaded and self.engine.hasher is not None:
            # The n-gram context of the loaded prefix (the window state would carry it).
            _, cache.ngram = self.engine.hasher.hash_ids(torch.tensor([tokens[: cache.length]]))
        if loaded < usable:  # a chunk was missing or bad: the windows after it instead
            windows = self._window_candidates(tokens, loaded)
            blobs = [None] * len(keys) + (self.store.get_many([key for _, key in windows]) if windows else [])
        return cache, loaded, self._load_window(cache, windows, blobs[len(keys):])

    def _window_candidates(self, tokens: list[int], chunks: int) -> list[tuple[int, ObjectKey]]:
        """Every window state the prompt could resume from after ``chunks`` chunks
        (leaving its last token to encode)."""
        return self.naming.window_candidates(tokens[:-1], chunks * self.naming.chunk_tokens)

    def _load_window(self, cache, candidates: list[tuple[int, ObjectKey]], blobs: list[bytes | None]) -> bool:
        """Resume from the previous turn's window state when this node still has it."""
        for (length, _), blob in zip(candidates, blobs):
            if blob is None:
                continue
            try:
                load_window(cache, blob, self.naming.identity)
            except StateError:
                continue
            if cache.length == length:
                return True
        return False
