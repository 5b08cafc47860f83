"""The cache plan of a prompt: what of it is stored and where, what a decoder replica
keeps in memory of it, and which stores still running it must wait for.

It computes the prompt's chunk keys and asks the Redis index for the longest stored
prefix and where it lives (:meth:`Planner.plan`). It follows what the decoder replicas
say at each answer's last token (:meth:`Planner.track_ending`): the conversations they keep
in memory for the next turn (:mod:`actors.resident`), and those they are storing. A turn
that continues a conversation whose store is still running waits for it, so that an
agent's next turn, sent the moment the answer is out, finds every chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from actors.events import Kept, Stored, Storing, Token
from actors.state import CachePlan, StoringConversation, media_of
from actors.store import STORE_TIMEOUT_S
from storage.keys import NO_SCOPE, KeyScope, ObjectKey

logger = logging.getLogger("ray.serve")

MAX_RESIDENT = 65536  # the last answers whose kept conversations are remembered


class Planner:
    """Plans for one router. ``naming``: the model's :class:`actors.state.StateNaming`;
    ``index``: the Redis location index (None: one node, whose store decides);
    ``resume_tokens``: the most new tokens a kept conversation is resumed with;
    ``usable``: the index's copies without those on lost hosts
    (:meth:`cluster.serving.liveness.NodeLiveness.usable`)."""

    def __init__(self, naming, index, metrics, resume_tokens: int, usable=lambda located: located):
        self.naming, self.index, self.metrics, self.resume_tokens = naming, index, metrics, resume_tokens
        self.usable = usable
        # The conversations decoder replicas keep for their next turn, by name.
        self.resident: OrderedDict[ObjectKey, Kept] = OrderedDict()
        # Conversations a decoder replica is storing (their last token is out), by the
        # name of their window state: a turn that continues one, or shares a chunk it
        # stores, waits for its store.
        self.storing: dict[ObjectKey, tuple[StoringConversation, asyncio.Future]] = {}
        self._following: set[asyncio.Task] = set()

    async def plan(self, tokens: list[int], images: tuple = (),
                   scope: KeyScope = NO_SCOPE) -> tuple[CachePlan, list[tuple[int, ObjectKey]]]:
        """Which leading chunks of the prompt are stored, where, and which window state
        after them the index knows of (one Redis round trip, two after a gap); and
        every window state the prompt could resume from after those chunks, known or
        not, as ``(length, key)`` (none without an index). ``images``: the prompt's
        :class:`actors.state.PromptImage` (their digests name the chunks that hold them);
        ``scope``: the tenant's, whose names alone the prompt may hit. A conversation
        the prompt continues, or shares a chunk with, whose store is still running is
        waited for (the wait is part of the ``plan`` stage)."""
        media = media_of(images)
        keys = self.naming.chunks(tokens, media=media, scope=scope)
        named = tuple(keys)
        if self.storing:
            await self.wait_for_stores(tokens, named, media, scope)
        unlocated = CachePlan(tuple(tokens), len(keys), chunk_keys=named, images=images, scope=scope)
        if self.index is None:  # one node: its store knows
            return unlocated, []
        size = self.naming.chunk_tokens
        usable = max(0, min(len(keys), (len(tokens) - 1) // size))  # the prefill encodes the last token
        windows = self.naming.window_candidates(tokens[:-1], usable * size, named, media, scope)
        now = time.time()
        located = self.index.locate(keys + [key for _, key in windows], now)
        if located is None:  # Redis away: as on one node, the prefill's own store decides
            return unlocated, windows
        located = self.usable(located)
        found_windows = located[len(keys):]
        depth = 0
        while depth < len(keys) and located[depth]:
            depth += 1
        if depth < usable:  # a gap: the windows after the stored run instead
            windows = self.naming.window_candidates(tokens[:-1], depth * size, named, media, scope)
            found_windows = self.index.locate([key for _, key in windows], now)
            if found_windows is None:
                return unlocated, windows
            found_windows = self.usable(found_windows)
        known = tuple((window, locations) for window, locations in zip(windows, found_windows) if locations)
        nodes = _nodes([known[0][1]] if known else [], located[depth - 1] if depth else None)
        return CachePlan(tuple(tokens), depth, nodes, tuple(window for window, _ in known), named, images,
                         scope), windows

    def take_resident(self, tokens: list[int], windows: list[tuple[int, ObjectKey]],
                      single: bool) -> tuple[ObjectKey, Kept] | None:
        """The conversation a decoder replica keeps that the prompt continues, as (its
        name, where), if it adds at most ``resume_tokens`` to it. ``single``: the request
        may resume one (one answer: each of ``n`` would need its own copy; no images: the
        vision tower is the prefill pool's). Forgotten here once taken: the request takes it."""
        if not single or not self.resume_tokens:
            return None
        for length, key in windows:  # longest first
            kept = self.resident.pop(key, None)
            if kept is not None:
                return (key, kept) if len(tokens) - length <= self.resume_tokens else None
        return None

    def forget(self, keys: list[ObjectKey]) -> None:
        """Deleted conversations: no turn resumes them from a decoder replica's memory
        (where they stay, unreachable, until evicted)."""
        for key in keys:
            self.resident.pop(key, None)

    async def wait_for_stores(self, tokens: list[int], named: tuple[ObjectKey, ...], media: tuple,
                              scope: KeyScope = NO_SCOPE) -> None:
        """Wait (up to the store's timeout) for the stores still running of the
        conversations this prompt continues or shares a new chunk with: an agent's
        next turn, sent the moment the answer was out, then finds every chunk of its
        history, and any turn planned after a last token reached the router finds what
        that answer stores."""
        import numpy as np

        ids, chunks = np.asarray(tokens, dtype="<i8"), set(named)
        running = [done for conversation, done in self.storing.values()
                   if not chunks.isdisjoint(conversation.keys[:-1])
                   or (conversation.length < len(ids)
                       and self.naming.window(ids[: conversation.length], named, media, scope) == conversation.window)]
        if running:
            started = time.perf_counter()
            await asyncio.wait(running, timeout=STORE_TIMEOUT_S)
            self.metrics.store_wait.observe(time.perf_counter() - started)

    def track_ending(self, last: Token, stream) -> None:
        """An answer's last token is here: note the conversation a decoder replica keeps,
        and follow the store it says is running to its end (the rest of ``stream``)."""
        if last.storing is None:
            return
        if last.storing.kept is not None:
            self.keep(last.storing.kept)
        self.follow_store(last.storing, stream)

    def keep(self, kept: Kept) -> None:
        """A decoder replica keeps the conversation ``kept`` names."""
        self.resident[kept.key] = kept
        self.resident.move_to_end(kept.key)
        while len(self.resident) > MAX_RESIDENT:
            self.resident.popitem(last=False)

    def follow_store(self, storing: Storing, stream) -> None:
        """A decoder replica is storing a conversation (its last token is out): held as
        running until the rest of ``stream`` says it is stored, or ends."""
        conversation = storing.conversation
        done = asyncio.get_running_loop().create_future()
        self.storing[conversation.window] = (conversation, done)

        async def until_stored() -> None:
            try:
                async for event in stream:
                    if isinstance(event, Stored):
                        break
            except Exception as error:  # noqa: BLE001 (the replica died: the next turn reads what was stored)
                logger.info("a decoder replica's stream ended before its store reported: %s", type(error).__name__)
            finally:
                if self.storing.get(conversation.window, (None, None))[1] is done:
                    del self.storing[conversation.window]
                done.set_result(None)

        task = asyncio.ensure_future(until_stored())
        self._following.add(task)
        task.add_done_callback(self._following.discard)


def _nodes(windows: list, chunk) -> tuple[str, ...]:
    """The nodes that hold the plan's best window state and its last stored chunk,
    those with them in RAM first, then on SSD, then the rest."""
    from storage.policy import TierName

    best = windows + ([chunk] if chunk is not None else [])
    order = sorted((loc for locations in best for loc in locations),
                   key=lambda loc: (loc.tier is not TierName.RAM, loc.tier is not TierName.SSD))
    return tuple(dict.fromkeys(loc.node_id for loc in order if loc.node_id != "*"))
