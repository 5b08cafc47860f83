"""The decoder pool: replay, continuous-batching decode, write the conversation back.

:class:`DecoderService` is the engine-side logic (tested without Ray; :class:`DecoderPool`
is its Serve deployment): it admits
handoffs from the prefill pool into a :class:`model.runtime.batcher.Batcher`, steps the
batch, and when a request ends normally writes the conversation's new whole chunks
and its window state to the node's store. A request that fails or is cancelled
writes nothing, so the store never holds a partial conversation.

An agent sends its next turn the moment the last answer is out. The replica starts
storing a finished conversation (the node's RAM tier, and its index entries in
Redis) as it sends the request's last token, which names the objects; the router
holds any later turn that continues the conversation until the stream's next event
says they are stored, so the next turn finds all of it, and the answer does not wait
for the store's round trips. Serialising a finished conversation
(:meth:`DecoderService.conversation_objects`) runs on the engine thread; the store
call runs on the event loop while the batch steps on.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from ray import serve

from actors.config import AppConfig
from model.tokenizer import Tokenizer
from model.runtime.batcher import Batcher, Speculation, TokenEvent
from model.runtime.cache import SequenceCache
from model.runtime.engine import Engine
from model.runtime.inputs import DecoderInput
from model.runtime.sampling import SamplingParams
from model.runtime.serialize import chunk_to_bytes, load_chunks, load_window, window_to_bytes
from storage.keys import NO_SCOPE, CacheRetention, KeyScope, MediaSpan, ObjectKey

from .events import Admission, Kept, Stored, Storing, Token, Tokens
from .prefill import Moved, PrefillService, StoreLike, read_through
from .store import STORE_TIMEOUT_S
from .replica import ModelBundle, engram_rows, node_id, one_thread_executor, prefilled
from .resident import ResidentConversations
from .state import CachePlan, Handoff, StateNaming, StoringConversation


@dataclass(frozen=True)
class _Conversation:
    """What a running request keeps for its write-back: the prompt and the names of
    its stored chunks (not the handoff's tensors and bytes, which admission used up)."""

    token_ids: tuple[int, ...]
    chunk_keys: tuple[ObjectKey, ...]
    stored_chunks: int
    media: tuple[MediaSpan, ...] = ()
    scope: KeyScope = NO_SCOPE  # the request's tenant's: its conversation's names


class PrefixUnavailable(RuntimeError):
    """The stored prefix a handoff names is in neither this node's store nor the one
    that served it to the prefill (evicted in between)."""


class DecoderService:
    """One decoder replica's batch, and its writes to the store."""

    def __init__(self, engine: Engine, store: StoreLike, naming: StateNaming, tokenizer: Tokenizer | None = None,
                 eos_token_ids: tuple[int, ...] = (), max_batch: int = 32, speculation: Speculation | None = None,
                 peers: Callable[[str], StoreLike | None] | None = None, resident_bytes: int = 0):
        """``peers(node_id)``: another node's store (None if it has none), for a prefix
        this node does not hold. ``resident_bytes``: memory for finished conversations
        kept for their next turn (:mod:`actors.resident`; 0: none kept)."""
        self.engine, self.store, self.naming, self.peers = engine, store, naming, peers
        self.batcher = Batcher(engine, tokenizer, eos_token_ids, max_batch, on_finish=self._finished,
                               speculation=speculation)
        self.resident = ResidentConversations(resident_bytes) if resident_bytes else None
        self._requests: dict[str, _Conversation] = {}
        # Finished conversations to store: (their new chunks and window state, their length).
        self._pending: dict[str, tuple[list[tuple[ObjectKey, bytes]], int]] = {}
        # Finished conversations to keep as they are stored: (the window state's name, tokens, cache).
        self._to_keep: dict[str, tuple[ObjectKey, tuple[int, ...], SequenceCache]] = {}
        self.last_admit_s = 0.0

    def admit(self, request_id: str, handoff: Handoff, params: SamplingParams,
              prefix: list[bytes | None] | None = None) -> TokenEvent:
        """Load a handoff, replay the decoder half, and return the first token.
        ``prefix``: the stored prefix's chunks, if already fetched (in order)."""
        cache = handoff.cache
        if cache is None:
            cache = self._load_prefix(handoff, prefix)
            load_window(cache, handoff.state, self.naming.identity)
        inputs = DecoderInput(handoff.positions, handoff.streams, handoff.pre, handoff.replay_ids,
                              handoff.replay_engram_ids)
        self._requests[request_id] = _Conversation(handoff.token_ids, handoff.chunk_keys, handoff.stored_chunks,
                                                   handoff.media, handoff.scope)
        start = time.perf_counter()
        try:
            return self.batcher.add(request_id, params, cache=cache, inputs=inputs)
        finally:
            self.last_admit_s = time.perf_counter() - start
            if request_id not in self.batcher.running:
                self._requests.pop(request_id, None)

    def _load_prefix(self, handoff: Handoff, fetched: list[bytes | None] | None = None) -> SequenceCache:
        """A cache holding the stored chunks the handoff names: those ``fetched`` already,
        the rest from this node's store, else from the node that served them (and kept
        here for the next turn)."""
        cache = self.engine.new_cache()
        keys = list(handoff.chunk_keys[: handoff.stored_chunks])
        if not keys:
            return cache
        moved = Moved()
        blobs = read_through(self.store, self.peers, keys, [handoff.prefix_node], fetched, moved)
        handoff.moved_bytes += moved.bytes
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
        """The batcher's :class:`model.runtime.speculative.SpecMetrics` (None without speculation)."""
        return self.batcher.metrics if self.batcher.speculation is not None else None

    def cancel(self, request_id: str) -> None:
        self.batcher.cancel(request_id)
        self._requests.pop(request_id, None)

    @property
    def running(self) -> int:
        return len(self.batcher.running)

    def _finished(self, request_id: str, cache: SequenceCache, generated: list[int]) -> None:
        # Serialised here, in the step that finished the request (on the engine thread
        # already): a later trip there would wait behind the queued steps and admissions.
        handoff = self._requests.pop(request_id, None)
        if handoff is not None:
            tokens = handoff.token_ids + tuple(generated[:-1])  # the last token was never fed
            objects = self._objects(handoff, cache, tokens)
            self._pending[request_id] = (objects, len(tokens))
            # (Not one whose request asked for host RAM only: the store's RAM tier keeps it
            # for the window's minutes, and nothing here would forget it when they end.)
            if self.resident is not None and handoff.scope.retention is not CacheRetention.IN_MEMORY:
                self._to_keep[request_id] = (objects[-1][0], tokens, cache)

    def conversation_objects(self, request_id: str) -> list[tuple[ObjectKey, bytes]]:
        """A finished request's new whole chunks and its window state, as (key, bytes),
        once (empty if it did not finish, or was taken already)."""
        return self.finished_conversation(request_id)[0]

    def finished_conversation(self, request_id: str) -> tuple[list[tuple[ObjectKey, bytes]], int]:
        """:meth:`conversation_objects` and the conversation's length in tokens (the
        window state, last of the objects, is the state after all of them)."""
        return self._pending.pop(request_id, ([], 0))

    def keep_resident(self, request_id: str) -> ObjectKey | None:
        """Keep a finished request's cache for the conversation's next turn (once its
        objects are on their way to the store); returns the name it is kept under
        (its window state's), or None if none is kept."""
        kept = self._to_keep.pop(request_id, None)
        if kept is None or self.resident is None or not self.resident.keep(*kept):
            return None
        return kept[0]

    def forget(self, request_id: str) -> None:
        """Drop a finished request's conversation without storing it."""
        self._pending.pop(request_id, None)
        self._to_keep.pop(request_id, None)

    def write_pending(self) -> None:
        """Store every finished conversation not stored yet (chunks and window state),
        and keep each one's cache when this service keeps conversations."""
        pending, self._pending = self._pending, {}
        for request_id, (objects, _) in pending.items():
            for key, payload in objects:
                self.store.put(key, payload)
            self.keep_resident(request_id)

    def _objects(self, handoff: _Conversation, cache: SequenceCache,
                 tokens: tuple[int, ...]) -> list[tuple[ObjectKey, bytes]]:
        if len(tokens) != cache.length:
            raise RuntimeError(f"cache holds {cache.length} tokens, the conversation {len(tokens)}")
        size = self.naming.chunk_tokens
        whole = cache.length // size
        keys = self.naming.chunks(tokens, known=handoff.chunk_keys, media=handoff.media, scope=handoff.scope)
        objects = [(keys[index], chunk_to_bytes(cache, index * size, size, self.naming.identity))
                   for index in range(handoff.stored_chunks, whole)]
        window = self.naming.window(tokens, known=tuple(keys), media=handoff.media, scope=handoff.scope)
        return objects + [(window, window_to_bytes(cache, whole * size, self.naming.identity))]


# ---------------------------------------------------------------------- deployment


@serve.deployment(max_ongoing_requests=64)
class DecoderPool:
    """A decoder replica: the whole model, one continuous batch, streaming tokens out."""

    def __init__(self, config: AppConfig):
        from actors.store import peer_store
        from actors.metrics import DecoderMetrics, LoopStats, PrefillMetrics

        self.bundle = bundle = ModelBundle(config)
        store = bundle.store(config)
        self.service = DecoderService(bundle.engine, store, bundle.naming, bundle.tokenizer,
                                      bundle.eos_ids, config.max_batch, speculation=bundle.speculation(config),
                                      peers=peer_store, resident_bytes=config.resident_mb << 20)
        # Short new prompts are encoded here (see cluster/serving/dispatcher.py): the same logic as a
        # prefill replica, on this replica's engine and store.
        self.node_id = node_id()
        # This replica's name for the request router: a conversation it keeps is sent back here.
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.prefiller = PrefillService(bundle.engine, store, bundle.naming, self.node_id, peer_store)
        self.executor = one_thread_executor(config.pin_engine_thread)
        self.metrics, self.prefill_metrics = DecoderMetrics(), PrefillMetrics()
        self.loop_counts = LoopStats()
        self.queues: dict[str, asyncio.Queue] = {}
        self.stepping: asyncio.Task | None = None
        self.slots = asyncio.Semaphore(config.max_batch)  # places in the batch
        self.queued = 0  # requests in this replica waiting for a place
        self.prefetched: OrderedDict[ObjectKey, asyncio.Future] = OrderedDict()

    async def prefetch(self, keys: tuple[ObjectKey, ...], preferred_nodes: list[str] | None = None,
                       preferred_replica: str | None = None) -> None:
        """Start reading a returning turn's stored prefix from this node's store while
        the prefill pool encodes the turn (the router sends it with the prefill): the
        handoff that follows finds its chunks here (on the replica the ingress chose for
        it, ``preferred_replica``). Kept for the last 16 prefixes."""
        if keys and keys[-1] not in self.prefetched:
            fetch = self.service.store.handle.get_many.remote(list(keys))
            self.prefetched[keys[-1]] = asyncio.ensure_future(fetch)
            while len(self.prefetched) > 16:
                self.prefetched.popitem(last=False)[1].cancel()

    async def generate(self, handoff, params, request_id: str, preferred_nodes: list[str] | None = None,
                       preferred_replica: str | None = None):
        """Yields the request's :class:`~actors.events.Token` events (the first with its
        admission), then :class:`~actors.events.Stored` when its conversation is stored.
        ``preferred_nodes`` and ``preferred_replica`` are read by the request router
        (cache affinity, and the replica the ingress chose)."""
        arrived = time.time()
        prefix = None
        if handoff.stored_chunks:
            fetch = self.prefetched.pop(handoff.chunk_keys[handoff.stored_chunks - 1], None)
            if fetch is not None:
                try:
                    prefix = await asyncio.wait_for(fetch, STORE_TIMEOUT_S)
                except Exception:  # the store actor was away: the admission reads it itself
                    prefix = None

        def admit():
            handoff.timeline["decode_in"] = arrived
            try:
                return handoff, self.service.admit(request_id, handoff, params, prefix)
            except PrefixUnavailable:
                # The stored prefix the prefill loaded went away before it could be read
                # here (a store restarted, or evicted it): encode the prompt here instead
                # (not one with images: the vision tower is the prefill pool's).
                if handoff.media:
                    raise
                plan = CachePlan(handoff.token_ids, 0, chunk_keys=handoff.chunk_keys, scope=handoff.scope)
                again = prefilled(self.prefiller.prefill(plan, in_process=True), time.time(), "decoder",
                                  self.prefill_metrics)
                again.timeline.update(handoff.timeline, decode_in=arrived)
                return again, self.service.admit(request_id, again, params)

        async for event in self._decode(request_id, admit):
            yield event

    async def prefill_and_generate(self, plan, params, request_id: str, engram=None,
                                   preferred_nodes: list[str] | None = None, resident: ObjectKey | None = None,
                                   preferred_replica: str | None = None):
        """:meth:`generate` for a prompt this replica encodes itself: no handoff to
        serialise, and the prefill and the first token in one trip to the engine thread.
        ``resident``: the name of a conversation the router believes this replica keeps
        (the prompt continues it): started from that cache if it is here, else from the
        store. ``preferred_replica`` is read by the request router (the replica the
        ingress chose: the one that keeps the conversation, or a less loaded one)."""
        arrived = time.time()
        rows = engram_rows(engram, self.prefill_metrics)

        def encode_and_admit():
            start = None
            if resident is not None and self.service.resident is not None:
                start = self.service.resident.take(resident, plan.token_ids)
                self.metrics.resident(start is not None)
            handoff = prefilled(self.prefiller.prefill(plan, rows, in_process=True, resident=start), arrived,
                                "resident" if start is not None else "decoder", self.prefill_metrics)
            handoff.timeline["decode_in"] = handoff.timeline["prefill_out"]
            return handoff, self.service.admit(request_id, handoff, params)

        async for event in self._decode(request_id, encode_and_admit):
            yield event

    async def _decode(self, request_id: str, admit):
        """Run ``admit`` (-> (handoff, first token)) on the engine thread, then stream
        the request's tokens from the batch. A request waits here, in arrival order, for
        a place in the batch (``max_batch``): more requests than that queue, none fails."""
        self.queued += 1
        self.metrics.queued.set(self.queued)
        try:
            await self.slots.acquire()
        finally:
            self.queued -= 1
            self.metrics.queued.set(self.queued)
        admitted = time.time()
        held = True

        def leave_batch() -> None:
            nonlocal held
            if held:
                held = False
                self.slots.release()

        events = self._admitted(request_id, admit, admitted, leave_batch)
        try:
            async for event in events:
                yield event
        finally:
            try:
                await events.aclose()  # a client gone: its request leaves the batch now
            finally:
                leave_batch()

    async def _admitted(self, request_id: str, admit, admitted: float, leave_batch: Callable[[], None]):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        finished = False  # the batch let go of it on its own
        try:
            handoff, event = await loop.run_in_executor(self.executor, admit)
            timeline = {**handoff.timeline, "admitted": admitted, "decode_out": time.time()}
            admission = Admission(handoff.cached_tokens, len(handoff.token_ids),
                                  handoff.prefill_s + self.service.last_admit_s, timeline, handoff.prefilled_by,
                                  handoff.moved_bytes, self.node_id, handoff.recomputed_tokens)
            tokens: list[Token] = []
            while True:
                storing, store = None, None
                if event.finish_reason is not None:
                    finished = True
                    leave_batch()  # its place is free while the conversation is stored
                    storing, store = self._store_conversation(request_id)
                tokens.append(Token.of(event, admission, storing))
                admission = None
                if event.finish_reason is not None:
                    yield self._item(tokens)
                    if store is not None:
                        yield await asyncio.shield(store)  # a stream closed now leaves the store running
                    return
                if queue.empty():  # out with what the steps made since the last item
                    yield self._item(tokens)
                    tokens = []
                    if self.stepping is None or self.stepping.done():
                        self.stepping = asyncio.create_task(self._step_loop())
                    event = await queue.get()
                else:
                    event = queue.get_nowait()
                if isinstance(event, BaseException):
                    raise event
        finally:
            self.queues.pop(request_id, None)
            if not finished:
                # Client gone, or a failure: drop the request from the batch. On the engine
                # thread, which runs its jobs in order: a client that left while its
                # admission was running there must not leave behind a request that holds
                # a place in the batch without a slot (the next admission would find the
                # batch full: a 503 under load). The cancel is queued before this
                # generator ends and frees the slot, so before any later admission.
                await loop.run_in_executor(self.executor, self.service.cancel, request_id)
            self.service.forget(request_id)  # finished, but its client left before the end

    def _store_conversation(self, request_id: str) -> tuple[Storing | None, asyncio.Future | None]:
        """Start storing a finished request's conversation in this node's RAM tier and
        indexing it; returns what the request's last token says of it (a
        :class:`~actors.events.Storing` naming the objects, and where the conversation is
        kept in memory) and the store call, whose end is the stream's one event after
        the last token (:class:`~actors.events.Stored`). The router holds a turn that
        continues the conversation until it is stored (:mod:`cluster.serving.planner`),
        so that the next turn, sent the moment the answer is complete, finds every
        chunk. The store runs on whether or not the stream is read to its end; one that
        does not answer in time costs the next turn its hit, never this request.
        Nothing to store: ``(None, None)``."""
        objects, length = self.service.finished_conversation(request_id)
        if not objects:
            return None, None

        async def store() -> Stored:
            stored = await self.service.store.put_now(objects)
            return Stored(time.time(), bool(stored))

        storing = asyncio.ensure_future(store())
        name = self.service.keep_resident(request_id)
        if self.service.resident is not None:
            self.metrics.resident_bytes.set(self.service.resident.stats().bytes)
        kept = Kept(name, self.replica_id, self.node_id) if name is not None else None  # the next turn comes here
        return Storing(StoringConversation(tuple(key for key, _ in objects), length), kept), storing

    def _item(self, tokens: list[Token]) -> Tokens:
        self.loop_counts.items += 1
        return Tokens(tuple(tokens))

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self.service.running:
            try:
                await loop.run_in_executor(self.executor, self._steps, loop)
            except Exception as error:  # a failed step fails every request in the batch
                for queue in self.queues.values():
                    queue.put_nowait(error)
                return

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread: step the batch until it is empty or another job waits
        for the thread (an admission, a cancel: they wait one step at most), handing
        each step's events to the event loop in one call. The engine steps back to back,
        not waiting for the event loop between steps."""
        self.loop_counts.runs += 1
        while self.service.running:
            batch = self.service.running
            began, cpu = time.perf_counter(), time.thread_time()
            events = self.service.step()
            self.loop_counts.stepped(len(events), time.perf_counter() - began, time.thread_time() - cpu)
            loop.call_soon_threadsafe(self._deliver, batch, events)
            if self.executor.waiting:
                return

    def _deliver(self, batch: int, events: list) -> None:
        """One step's events, to their requests' queues (on the event loop)."""
        self.metrics.step(batch, len(events), self.service.running, self.service.spec_metrics)
        for event in events:
            queue = self.queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)

    def loop_stats(self):
        """A copy of this replica's :class:`~actors.metrics.LoopStats` so far."""
        return replace(self.loop_counts)

    def running(self) -> int:
        return self.service.running

    def check_health(self) -> None:
        """Serve's health check: a replica that lost an expert worker is replaced whole."""
        self.bundle.check_health()

    def node(self) -> str:
        return node_id()
