"""The prefill encoder pool: load the stored prefix, encode the new tokens, hand off.

:class:`PrefillService` is the engine-side logic (tested without Ray);
:class:`PrefillPool`, the Serve deployment, is a thin wrapper around it.

For a request it (1) reads the stored chunks of the prompt's cached prefix from its
node's store, (2) looks for the window state of the conversation's previous turn
(host RAM, minutes): with it the windows are exact; without it the encoder reruns
the last window of cached tokens (Encoder SWA Bounded Replay), (3) encodes the new
tokens, and (4) returns a :class:`Handoff`: the names of the stored chunks it loaded,
the rest of the cache serialized, and the decoder input.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Protocol

import torch
from ray import serve

from actors.config import AppConfig
from model.runtime.cache import SequenceCache
from model.runtime.engine import Engine
from model.runtime.inputs import DecoderInput
from model.runtime.serialize import StateError, load_chunks, load_window, window_to_bytes
from storage.keys import ObjectKey

from .move_cost import MoveCost
from .pool_model import ImageEncoder
from .replica import ModelBundle, engram_rows, node_id, one_thread_executor, prefilled
from .state import CachePlan, Handoff, StateNaming


class StoreLike(Protocol):
    """The part of the tiered store the pools use (a TieredStore or a store actor client)."""

    def get_many(self, keys: list[ObjectKey]) -> list[bytes | None]: ...

    def put(self, key: ObjectKey, payload: bytes) -> None: ...


class Moved:
    """Bytes a request read from other nodes' stores (the cost of moving its cache), and
    the objects it chose not to read from them (cheaper to encode again)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.declined = 0


def read_through(store: StoreLike, peers: Callable[[str], StoreLike | None] | None, keys: list[ObjectKey],
                 nodes: tuple[str | None, ...] | list[str | None],
                 fetched: list[bytes | None] | None = None, moved: Moved | None = None,
                 cost: MoveCost | None = None, chunk_tokens: int = 0) -> list[bytes | None]:
    """``store.get_many(keys)``, and what it misses from the stores of ``nodes`` in turn
    (node to node, never through the router), kept in ``store`` for the next turn.
    ``peers(node)`` gives a node's store, None if it has none. ``fetched``: what was
    already read for the first keys (a prefetch); only the rest is asked of ``store``.
    ``moved`` counts the bytes read from other nodes. ``cost``: reads from a node are
    timed, and made only where moving beats encoding ``chunk_tokens`` per object again."""
    blobs = list(fetched or ())[: len(keys)]
    blobs += [None] * (len(keys) - len(blobs))
    missing = [i for i, blob in enumerate(blobs) if blob is None]
    if missing:
        for i, blob in zip(missing, store.get_many([keys[i] for i in missing])):
            blobs[i] = blob
        if cost is not None:
            cost.sized(sum(len(blobs[i]) for i in missing if blobs[i]), sum(1 for i in missing if blobs[i]))
        missing = [i for i in missing if blobs[i] is None]
    for node in nodes:
        peer = peers(node) if missing and peers is not None and node else None
        if peer is None:
            continue
        if cost is not None and not cost.worth_moving(node, len(missing), chunk_tokens):
            if moved is not None:
                moved.declined += len(missing)
            continue
        started = time.perf_counter()
        found = peer.get_many([keys[i] for i in missing])
        if cost is not None:
            cost.read(node, sum(len(blob) for blob in found if blob), sum(1 for blob in found if blob),
                      time.perf_counter() - started, asked=len(missing))
        for i, blob in zip(missing, found):
            if blob is not None:
                blobs[i] = blob
                store.put(keys[i], blob)
                if moved is not None:
                    moved.bytes += len(blob)
        missing = [i for i in missing if blobs[i] is None]
    return blobs


class PrefillService:
    """Turns cache plans into handoffs with one engine and one node store."""

    def __init__(self, engine: Engine, store: StoreLike, naming: StateNaming, node_id: str | None = None,
                 peers: Callable[[str], StoreLike | None] | None = None, images: ImageEncoder | None = None):
        """``node_id``: the node whose store ``store`` is (named in handoffs, so that a
        decoder elsewhere can read the prefix from it); ``peers(node_id)``: another
        node's store, read for what the plan says is stored there and this node lacks.
        ``images``: the vision tower (a prefill replica of a model that reads images)."""
        self.engine, self.store, self.naming, self.node_id, self.peers = engine, store, naming, node_id, peers
        self.images = images
        self.cost = MoveCost()  # read another node's chunks, or encode them again

    def prefill(self, plan: CachePlan, engram_rows: Callable[[], dict[int, torch.Tensor]] | None = None,
                in_process: bool = False, resident: SequenceCache | None = None) -> Handoff:
        """Encode a request. ``engram_rows`` (optional) returns the Engram rows of the
        whole prompt [S, cols, hd] per layer, fetched remotely while this runs.
        ``in_process``: the handoff carries the cache itself, not its bytes (for a
        decoder in this process). ``resident``: the cache of the prompt's first
        ``resident.length`` tokens, kept by this process (:mod:`actors.resident`):
        nothing is read from the store, only the rest is encoded (in process only)."""
        tokens = list(plan.token_ids)
        if not tokens:
            raise ValueError("empty prompt")
        if plan.images and self.images is None:
            raise ValueError("this replica has no vision tower: an image prompt goes to a prefill replica")
        spans = self.images.spans(plan.images) if plan.images else []
        start, read_at = time.perf_counter(), time.time()  # read_at: when this looked for the stored prefix
        keys = (tuple(plan.chunk_keys) if plan.chunk_keys is not None
                else tuple(self.naming.chunks(tokens, media=plan.media, scope=plan.scope)))
        moved = Moved()
        if resident is not None:
            if not in_process or resident.length >= len(tokens):
                raise ValueError("a resident cache continues in process, with at least one token to encode")
            # Its whole chunks were stored with it; those the index does not know are
            # stored again with the answer.
            chunks_read = min(plan.cached_chunks, resident.length // self.naming.chunk_tokens)
            cache, resumed = resident, True
        else:
            cache, chunks_read, resumed = self._load_stored(tokens, plan, keys, moved)
        replay: DecoderInput | None = None
        if not resumed and cache.length:
            replay = self.engine.restore(cache, tokens[: cache.length], images=spans)
        cached = cache.length
        rows = None
        if engram_rows is not None:  # rows of the whole prompt: keep the new tokens'
            rows = lambda: {layer: r[cached:] for layer, r in engram_rows().items()}  # noqa: E731
        encoding = time.perf_counter()
        fresh = self.engine.prefill(cache, tokens[cached:], engram_rows=rows, images=spans)
        self.cost.encoded(len(tokens) - cached, time.perf_counter() - encoding)
        # Only what the decoder's replay reads travels (a bounded replay: the last window).
        inputs = self.engine.replayed(cache, replay.then(fresh) if replay is not None else fresh)
        if not in_process:
            inputs = inputs.compact()
        chunked = chunks_read * self.naming.chunk_tokens
        return Handoff(
            token_ids=tuple(tokens),
            state=b"" if in_process else window_to_bytes(cache, chunked, self.naming.identity),
            cache=cache if in_process else None,
            positions=inputs.positions,
            streams=inputs.streams,
            pre=inputs.pre,
            replay_ids=inputs.token_ids,
            replay_engram_ids=inputs.engram_ids,
            cached_tokens=cached,
            stored_chunks=chunks_read,
            chunk_keys=keys,
            prefix_node=self.node_id,
            prefill_s=time.perf_counter() - start,
            moved_bytes=moved.bytes,
            recomputed_tokens=(max(0, self.naming.loadable_chunks(plan) - chunks_read) * self.naming.chunk_tokens
                               if moved.declined else 0),
            media=plan.media,
            scope=plan.scope,
            timeline={"prefill_read": read_at},
        )

    def _load_stored(self, tokens: list[int], plan: CachePlan, chunk_keys: tuple[ObjectKey, ...], moved: Moved):
        """The longest run of stored chunks that verifies (a bad chunk ends the run),
        then the window state after them if the store has it. One store call when the
        chunks are good; none when the plan says nothing is stored."""
        cache = self.engine.new_cache()
        usable = self.naming.loadable_chunks(plan)
        keys = list(chunk_keys[:usable])
        # The router asked the index for the windows after exactly these chunks.
        windows = (list(plan.windows) if plan.windows is not None
                   else self._window_candidates(tokens, usable, chunk_keys, plan))
        others = [node for node in plan.nodes if node != self.node_id]
        blobs = read_through(self.store, self.peers, keys + [key for _, key in windows], others, moved=moved,
                             cost=self.cost, chunk_tokens=self.naming.chunk_tokens)
        present = itertools.takewhile(lambda blob: blob is not None, blobs[: len(keys)])
        loaded = load_chunks(cache, present, self.naming.identity)  # up to a missing or bad chunk
        if loaded and self.engine.hasher is not None:
            # The n-gram context of the loaded prefix (the window state would carry it).
            cache.ngram = self.engine.ngram_context(tokens[: cache.length])
        if loaded < usable:  # a chunk was missing or bad: the windows after it instead
            windows = self._window_candidates(tokens, loaded, chunk_keys, plan)
            blobs = [None] * len(keys) + read_through(self.store, self.peers, [key for _, key in windows], others,
                                                      moved=moved, cost=self.cost,
                                                      chunk_tokens=self.naming.chunk_tokens)
        return cache, loaded, self._load_window(cache, windows, blobs[len(keys):])

    def _window_candidates(self, tokens: list[int], chunks: int, chunk_keys: tuple[ObjectKey, ...],
                           plan: CachePlan) -> list[tuple[int, ObjectKey]]:
        """Every window state the prompt could resume from after ``chunks`` chunks
        (leaving its last token to encode), in the plan's scope."""
        return self.naming.window_candidates(tokens[:-1], chunks * self.naming.chunk_tokens, chunk_keys[:chunks],
                                             plan.media, plan.scope)

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


# ---------------------------------------------------------------------- deployment


@serve.deployment  # its request router: cluster/serving/app.py, from the config's `routing`
class PrefillPool:
    """A prefill replica: the encoder half and the CED projection, and its node's store."""

    def __init__(self, config: AppConfig):
        from actors.store import peer_store
        from actors.metrics import PrefillMetrics

        self.bundle = bundle = ModelBundle(config, drop_decoder=True)
        self.service = PrefillService(bundle.engine, bundle.store(config), bundle.naming, node_id(), peer_store,
                                      bundle.image_encoder())
        self.executor = one_thread_executor(config.pin_engine_thread)
        self.metrics = PrefillMetrics()

    def node(self) -> str:
        """The Ray node this replica runs on (placement checks, tests)."""
        return node_id()

    def check_health(self) -> None:
        """Serve's health check: a replica that lost an expert worker is replaced whole."""
        self.bundle.check_health()

    async def prefill(self, plan, preferred_nodes: list[str] | None = None, engram=None):
        """``preferred_nodes`` is read by the request router (cache affinity)."""
        arrived = time.time()
        rows = engram_rows(engram, self.metrics)
        handoff = await asyncio.get_running_loop().run_in_executor(self.executor, self.service.prefill, plan, rows)
        return prefilled(handoff, arrived, "pool", self.metrics)
