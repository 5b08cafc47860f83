"""Conversations a decoder replica keeps in memory after answering them.

An agent's next turn comes back within seconds: a tool ran and appended a few hundred
tokens to the whole history. The replica that answered the last turn still has the
conversation's cache, every layer of it, in memory. Kept here, the next turn, routed
back to this replica (cluster/serving/routing.py), starts from it: only the new tokens are
encoded, with no store read, no handoff and no trip through the prefill pool.

It is a shortcut, never the only copy. The replica stores the same state (its chunks
and window state) as it sends the answer's last token, so a conversation evicted
here, taken by another request, or kept by a replica that has died is read from the
store as before. A conversation is taken (not copied) by the request that continues
it: two requests that share a prefix cannot both extend one cache; the second reads
the store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from model.runtime.cache import SequenceCache
from storage.keys import ObjectKey


@dataclass(frozen=True)
class ResidentStats:
    conversations: int
    bytes: int
    kept: int  # conversations ever kept
    resumed: int  # requests that started from one
    missed: int  # requests that named one this replica did not have (evicted, taken, never here)
    evicted: int  # dropped for room


@dataclass
class _Resident:
    tokens: tuple[int, ...]
    cache: SequenceCache
    nbytes: int


class ResidentConversations:
    """Finished conversations' caches by the name of their window state (the store's
    name for the state after exactly their tokens), least recently kept dropped first
    beyond ``budget_bytes``. Thread-safe: kept from the event loop, taken on the
    engine thread."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self._held: OrderedDict[ObjectKey, _Resident] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._kept = self._resumed = self._missed = self._evicted = 0

    def keep(self, key: ObjectKey, tokens: Sequence[int], cache: SequenceCache) -> bool:
        """Keep ``cache``, the state after exactly ``tokens`` (``cache.length`` of them),
        under ``key``. False (nothing kept) when it alone exceeds the budget."""
        if len(tokens) != cache.length:
            raise ValueError(f"a cache of {cache.length} tokens kept as the state after {len(tokens)}")
        nbytes = cache.allocated_bytes()
        if nbytes > self.budget:
            return False
        with self._lock:
            old = self._held.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._held[key] = _Resident(tuple(tokens), cache, nbytes)
            self._bytes += nbytes
            self._kept += 1
            while self._bytes > self.budget:
                _, dropped = self._held.popitem(last=False)
                self._bytes -= dropped.nbytes
                self._evicted += 1
        return True

    def take(self, key: ObjectKey, prompt: Sequence[int]) -> SequenceCache | None:
        """The cache kept under ``key``, removed from here, if its tokens begin
        ``prompt`` and leave at least the prompt's last token to encode; else None.
        (A cache under ``key`` whose tokens do not begin the prompt is dropped: the
        name, a hash of the tokens, collided.)"""
        with self._lock:
            resident = self._held.get(key)
            length = 0 if resident is None else len(resident.tokens)
            if resident is None or length >= len(prompt):
                self._missed += 1
                return None
            del self._held[key]
            self._bytes -= resident.nbytes
            if tuple(prompt[:length]) != resident.tokens:
                self._missed += 1
                return None
            self._resumed += 1
            return resident.cache

    def __contains__(self, key: ObjectKey) -> bool:
        with self._lock:
            return key in self._held

    def stats(self) -> ResidentStats:
        with self._lock:
            return ResidentStats(len(self._held), self._bytes, self._kept, self._resumed, self._missed, self._evicted)
