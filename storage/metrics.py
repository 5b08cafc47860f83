"""Counters of the tiered store: hits, misses and bytes per tier, evictions, expirations, GC.

Tiers and background threads bump counters concurrently, so each counter set has a
lock; readers get frozen snapshots.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TierStats:
    """A snapshot of one tier's counters (totals since the store opened)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    puts: int = 0
    bytes_written: int = 0
    evictions: int = 0  # removed to make room
    expirations: int = 0  # removed because their retention ran out
    corrupt: int = 0  # failed verification, removed, read as a miss
    write_errors: int = 0  # writes dropped (disk full after eviction, Redis down, queue full)


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the whole store."""

    tiers: dict[str, TierStats]
    objects: dict[str, int]  # objects held per local tier now
    bytes_stored: dict[str, int]  # bytes held per local tier now
    gc_runs: int
    index_pending: int  # location updates waiting for Redis
    index_resyncs: int  # full republishes after Redis came back empty or lost updates
    redis_errors: int
    redis_up: bool


class TierCounters:
    """Mutable, thread-safe counters of one tier."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {f.name: 0 for f in fields(TierStats)}

    def add(self, **deltas: int) -> None:
        """Add to named counters, e.g. ``add(hits=1, bytes_read=n)``."""
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def reads(self, hits: int, misses: int, bytes_read: int, expirations: int = 0) -> None:
        """``add`` for a read, without building a keyword dict (the store's hot path)."""
        with self._lock:
            values = self._values
            values["hits"] += hits
            values["misses"] += misses
            values["bytes_read"] += bytes_read
            values["expirations"] += expirations

    def writes(self, puts: int, bytes_written: int, evictions: int = 0) -> None:
        """``add`` for a write (the hot path)."""
        with self._lock:
            values = self._values
            values["puts"] += puts
            values["bytes_written"] += bytes_written
            values["evictions"] += evictions

    def snapshot(self) -> TierStats:
        with self._lock:
            return TierStats(**self._values)
