"""Host RAM tier: an LRU pool bounded in bytes, with a retention time per object kind.

Objects are kept as the caller's immutable ``bytes``; nothing here is serialized, so
there is nothing to verify. Chunks stay until evicted or 72 h unused; window states
expire after minutes (``RetentionPolicy.window_ttl_minutes``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from storage.keys import Kind, ObjectKey
from storage.metrics import TierCounters
from storage.policy import RetentionPolicy, TierName
from storage.tier import LocalTier, OnDrop, payload_size
from storage.sized import SizedPayload


class _Entry:
    __slots__ = ("expires", "kind", "payload", "size", "ttl")

    def __init__(self, kind: Kind, payload: bytes, size: int, ttl: float, expires: float) -> None:
        self.kind = kind
        self.payload = payload
        self.size = size  # len(payload), kept: the accounting needs no call
        self.ttl = ttl  # the kind's retention, kept here: a read needs no look-up by kind
        self.expires = expires


class RamTier(LocalTier):
    """LRU byte pool. A capacity of 0 disables it (every put is refused)."""

    name = TierName.RAM

    def __init__(self, policy: RetentionPolicy, clock: Callable[[], float], counters: TierCounters,
                 on_drop: OnDrop | None) -> None:
        """``on_drop`` None: nobody is told of drops (evictions then build no keys)."""
        # Retention per kind, looked up once: every kind may live in RAM.
        self._ttl = {kind: policy.ram_retention_s(kind) for kind in Kind}
        self._capacity = policy.ram_capacity_bytes
        self._clock = clock
        self._counters = counters
        self._on_drop = on_drop
        self._lock = threading.Lock()
        # Keyed by digest (bytes hash fast, and digests never collide across kinds);
        # least recently used first. The same entries per kind, in the same order, so
        # that GC walks only the expired ones (one kind's retention is the same for all).
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._by_kind: dict[Kind, OrderedDict[bytes, _Entry]] = {kind: OrderedDict() for kind in Kind}
        self._bytes = 0

    def _pop(self, digest: bytes) -> _Entry | None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            del self._by_kind[entry.kind][digest]
            self._bytes -= entry.size
        return entry

    def contains(self, key: ObjectKey) -> bool:
        with self._lock:
            entry = self._entries.get(key.digest)
            return entry is not None and entry.kind is key.kind and entry.expires > self._clock()

    def get(self, key: ObjectKey) -> bytes | None:
        return self.get_many((key,))[0]

    def get_many(self, keys: Sequence[ObjectKey], prefix: bool = False) -> list[bytes | None]:
        """The payload of each key or None; with ``prefix``, only the payloads up to the
        first miss (that miss counted, the keys after it not looked at)."""
        now = self._clock()
        results: list[bytes | None] = []
        append = results.append
        expired: list[ObjectKey] = []
        misses = hit_bytes = 0
        with self._lock:  # one lock round for the whole batch; the loop is the hot path of a RAM hit
            get = self._entries.get
            move_to_end = self._entries.move_to_end
            by_kind = self._by_kind
            for key in keys:
                digest = key.digest
                entry = get(digest)
                if entry is not None and entry.kind is key.kind:
                    if entry.expires > now:
                        entry.expires = now + entry.ttl
                        move_to_end(digest)
                        by_kind[entry.kind].move_to_end(digest)
                        append(entry.payload)
                        hit_bytes += entry.size
                        continue
                    self._pop(digest)
                    expired.append(key)
                misses += 1
                if prefix:
                    break
                append(None)
        hits = len(results) if prefix else len(results) - misses
        self._counters.reads(hits, misses, hit_bytes, len(expired))
        if self._on_drop is not None:
            for key in expired:
                self._on_drop(key)
        return results

    def put(self, key: ObjectKey, payload: bytes) -> bool:
        size = payload_size(payload)
        if size > self._capacity:
            return False
        now = self._clock()
        evicted: list[ObjectKey] = []
        evictions = 0
        with self._lock:
            self._pop(key.digest)
            while self._bytes + size > self._capacity:
                digest, old = next(iter(self._entries.items()))
                self._pop(digest)
                evictions += 1
                if self._on_drop is not None:
                    evicted.append(ObjectKey(old.kind, digest))
            ttl = self._ttl[key.kind]
            entry = _Entry(key.kind, payload, size, ttl, now + ttl)
            self._entries[key.digest] = self._by_kind[key.kind][key.digest] = entry
            self._bytes += size
        self._counters.writes(1, size, evictions)
        on_drop = self._on_drop
        if on_drop is not None:
            for old_key in evicted:
                on_drop(old_key)
        return True

    def remove(self, key: ObjectKey) -> bool:
        with self._lock:
            removed = self._pop(key.digest) is not None
        if removed and self._on_drop is not None:
            self._on_drop(key)
        return removed

    def gc(self) -> None:
        now = self._clock()
        expired: list[tuple[Kind, bytes]] = []
        with self._lock:
            for kind, entries in self._by_kind.items():
                for digest, entry in entries.items():  # oldest first: stop at the first one still kept
                    if entry.expires > now:
                        break
                    expired.append((kind, digest))
            for _, digest in expired:
                self._pop(digest)
        self._counters.add(expirations=len(expired))
        if self._on_drop is not None:  # (keys only for a listener: the retention lab expires millions unheard)
            for kind, digest in expired:
                self._on_drop(ObjectKey(kind, digest))

    def entries(self) -> list[tuple[ObjectKey, float]]:
        with self._lock:
            return [(ObjectKey(entry.kind, digest), entry.expires) for digest, entry in self._entries.items()]

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._entries), self._bytes

    def sized_state(self) -> Iterator[tuple[bytes, int, int, float]]:
        """(digest, kind, size, expiry) of every object, least recently used first, one
        at a time (the tier stays locked until they are all taken): what the retention
        lab's checkpoints keep of a RAM tier whose payloads stand for sizes."""
        with self._lock:
            for digest, e in self._entries.items():
                yield digest, int(e.kind), e.size, e.expires

    def restore_sized(self, rows) -> None:
        """Hold ``rows`` (as :meth:`sized_state` gives them) as sized payloads, in that order."""
        with self._lock:
            for digest, kind, size, expires in rows:
                kind = Kind(kind)
                entry = _Entry(kind, SizedPayload(size), size, self._ttl[kind], expires)
                self._entries[digest] = self._by_kind[kind][digest] = entry
                self._bytes += size

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            for entries in self._by_kind.values():
                entries.clear()
            self._bytes = 0
