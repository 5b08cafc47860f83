"""Host RAM tier: an LRU pool bounded in bytes, with a retention time per object kind.

Objects are kept as the caller's immutable ``bytes``; nothing here is serialized, so
there is nothing to verify. Chunks stay until evicted or 72 h unused; window states
expire after minutes (``RetentionPolicy.window_ttl_minutes``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from storage.keys import Kind, ObjectKey
from storage.metrics import TierCounters
from storage.policy import RetentionPolicy, TierName
from storage.tiers.base import LocalTier, OnDrop


class _Entry:
    __slots__ = ("kind", "payload", "expires")

    def __init__(self, kind: Kind, payload: bytes, expires: float) -> None:
        self.kind = kind
        self.payload = payload
        self.expires = expires


class RamTier(LocalTier):
    """LRU byte pool. A capacity of 0 disables it (every put is refused)."""

    name = TierName.RAM

    def __init__(self, policy: RetentionPolicy, clock: Callable[[], float], counters: TierCounters,
                 on_drop: OnDrop) -> None:
        # Retention per kind, looked up once: every kind may live in RAM.
        self._ttl = {kind: policy.retention_s(kind, TierName.RAM) for kind in Kind}
        self._capacity = policy.ram_capacity_bytes
        self._clock = clock
        self._counters = counters
        self._on_drop = on_drop
        self._lock = threading.Lock()
        # Keyed by digest (bytes hash fast, and digests never collide across kinds);
        # least recently used first.
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._bytes = 0

    def _pop(self, digest: bytes) -> _Entry | None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self._bytes -= len(entry.payload)
        return entry

    def contains(self, key: ObjectKey) -> bool:
        with self._lock:
            entry = self._entries.get(key.digest)
            return entry is not None and entry.kind is key.kind and entry.expires > self._clock()

    def get(self, key: ObjectKey) -> bytes | None:
        return self.get_many((key,))[0]

    def get_many(self, keys: Sequence[ObjectKey]) -> list[bytes | None]:
        now = self._clock()
        results: list[bytes | None] = []
        expired: list[ObjectKey] = []
        hits = hit_bytes = 0
        with self._lock:  # one lock round for the whole batch
            entries = self._entries
            for key in keys:
                entry = entries.get(key.digest)
                if entry is not None and entry.kind is key.kind:
                    if entry.expires > now:
                        entry.expires = now + self._ttl[key.kind]
                        entries.move_to_end(key.digest)
                        results.append(entry.payload)
                        hits += 1
                        hit_bytes += len(entry.payload)
                        continue
                    self._pop(key.digest)
                    expired.append(key)
                results.append(None)
        self._counters.add(hits=hits, misses=len(keys) - hits, bytes_read=hit_bytes, expirations=len(expired))
        for key in expired:
            self._on_drop(key)
        return results

    def put(self, key: ObjectKey, payload: bytes) -> bool:
        size = len(payload)
        if size > self._capacity:
            return False
        now = self._clock()
        evicted: list[ObjectKey] = []
        with self._lock:
            self._pop(key.digest)
            while self._bytes + size > self._capacity:
                digest, old = self._entries.popitem(last=False)
                self._bytes -= len(old.payload)
                evicted.append(ObjectKey(old.kind, digest))
            self._entries[key.digest] = _Entry(key.kind, payload, now + self._ttl[key.kind])
            self._bytes += size
        self._counters.add(puts=1, bytes_written=size, evictions=len(evicted))
        for old_key in evicted:
            self._on_drop(old_key)
        return True

    def remove(self, key: ObjectKey) -> bool:
        with self._lock:
            removed = self._pop(key.digest) is not None
        if removed:
            self._on_drop(key)
        return removed

    def gc(self) -> None:
        now = self._clock()
        with self._lock:
            expired = [ObjectKey(entry.kind, digest) for digest, entry in self._entries.items()
                       if entry.expires <= now]
            for key in expired:
                self._pop(key.digest)
        self._counters.add(expirations=len(expired))
        for key in expired:
            self._on_drop(key)

    def entries(self) -> list[tuple[ObjectKey, float]]:
        with self._lock:
            return [(ObjectKey(entry.kind, digest), entry.expires) for digest, entry in self._entries.items()]

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._entries), self._bytes

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
