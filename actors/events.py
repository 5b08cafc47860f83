"""What a decoder replica's stream tells the router: typed events.

A request's stream is its tokens in order, each a :class:`Token`, sent in
:class:`Tokens` items: each item carries the tokens the request made since the last
one went out (one per decode step while the replica keeps up; several when its event
loop falls behind the engine, so that a busy replica sends fewer, larger items); the
router reads them one token at a time through :class:`TokenStream`. The first carries
its :class:`Admission` (how the prompt was encoded and admitted: one stream item fewer
than a separate event); the last carries, when the replica is storing the
conversation, a :class:`Storing` that names the objects (and where the conversation is
kept in memory for its next turn), and the stream's one event after it is
:class:`Stored`, when the store answered. A failure is raised through the stream (Ray
carries the exception), never sent as an event.

The events cross Ray's object store between the decoder replica and the router, so they
are plain frozen dataclasses (they pickle). The decoder (:mod:`actors.decoder`) writes
them; the router (:mod:`cluster.serving.answers`, :mod:`cluster.serving.planner`) reads them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from model.runtime.batcher import TokenEvent
from storage.keys import ObjectKey

from .state import StoringConversation


@dataclass(frozen=True)
class Admission:
    """How a request's first token came to be: the prompt's length and how much of it
    was read from the cache, the replicas' own compute (prefill, replay, first sample),
    the trip's marks (Unix seconds by name: ``prefill_in``, ``decode_out``, ...), who
    encoded the prompt (``pool``, ``decoder``, ``resident``), the bytes moved between
    nodes for it, the decoder replica's node, and the stored tokens encoded again
    because moving them would have cost more (:mod:`actors.move_cost`)."""

    cached_tokens: int
    prompt_tokens: int
    replica_s: float
    timeline: dict[str, float]
    prefilled_by: str
    moved_bytes: int
    node: str
    recomputed_tokens: int = 0  # stored on another node, encoded again: cheaper than moving them


@dataclass(frozen=True)
class Kept:
    """A finished conversation a decoder replica keeps in memory for its next turn
    (:mod:`actors.resident`): its name (its window state's), the replica (Serve's id for
    it) and the replica's node."""

    key: ObjectKey
    replica: str
    node: str


@dataclass(frozen=True)
class Storing:
    """The conversation a request's last token ended, being stored; ``kept``: where it
    is also kept in memory (None: nowhere)."""

    conversation: StoringConversation
    kept: Kept | None = None


@dataclass(frozen=True)
class Token:
    """One generated token. ``finish_reason`` is set on the request's last;
    ``admission`` on its first; ``storing`` on its last when the conversation is
    being stored (the stream's next event is then :class:`Stored`)."""

    token_id: int
    text: str
    finish_reason: str | None = None
    logprob: float | None = None  # when the request asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()
    admission: Admission | None = None
    storing: Storing | None = None

    @classmethod
    def of(cls, event: TokenEvent, admission: Admission | None = None, storing: Storing | None = None) -> Token:
        """The batcher's event as the stream sends it."""
        return cls(event.token_id, event.text, event.finish_reason, event.logprob, event.top_logprobs, admission,
                   storing)


@dataclass(frozen=True)
class Stored:
    """The store answered for the conversation a request's last token named: when
    (Unix seconds), and whether it took it in time."""

    at: float
    stored: bool


@dataclass(frozen=True)
class Tokens:
    """The tokens of one request made since its stream's last item, in order (one
    stream item)."""

    tokens: tuple[Token, ...]


class HostLost(Exception):
    """The host of the replica a stream came from was lost or cut off (the router's
    :class:`cluster.serving.liveness.NodeLiveness` says so, long before Ray would)."""


class TokenStream:
    """A decoder replica's stream (Serve's response generator) read one event at a
    time: each :class:`Token` of the :class:`Tokens` items, then :class:`Stored`.
    :meth:`lose` ends it with :class:`HostLost`, also while a read waits."""

    def __init__(self, stream):
        self.stream = stream
        self._held: deque[Token] = deque()
        self._lost: str | None = None
        self._reader: asyncio.Task | None = None  # the task waiting for the next item

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> Token | Stored:
        if self._lost is not None:
            raise HostLost(self._lost)
        if not self._held:
            self._reader = asyncio.current_task()
            try:
                item = await self.stream.__anext__()
            except BaseException:
                if self._lost is None:
                    raise
                if self._reader.cancelling():
                    self._reader.uncancel()  # (cancelled by lose(), not by its caller)
                raise HostLost(self._lost) from None
            finally:
                self._reader = None
            if not isinstance(item, Tokens):
                return item
            self._held.extend(item.tokens)
        return self._held.popleft()

    def cancel(self) -> None:
        self.stream.cancel()

    def lose(self, why: str) -> None:
        """The replica's host is gone: a waiting read, and every later one, raises
        :class:`HostLost`; the call is cancelled (best effort: its host may not hear)."""
        self._lost = why
        if self._reader is not None:
            self._reader.cancel()
        self.stream.cancel()
