"""Retention policy: what lives where, and for how long. Every number is config.

V4.1 keeps a conversation's long-range chunks for 72 hours after their last use, in
host RAM while it is hot and on the node's SSD after; window states (the last 128
tokens of every layer) live only in host RAM for minutes. ``persist_window_states``
turns on V4-style storage, where window states go to SSD too, for experiments.
Stored Responses API responses and Conversations API conversations (the text of a
conversation, not its cache) stay in RAM for the window's minutes and on SSD for
``response_retention_hours`` after their last use (a read from the store is a use).

A request may ask for less (``prompt_cache_retention``, :class:`storage.keys.CacheRetention`):
its chunks and window states are then of their own kinds, kept at most 24 hours
anywhere, or in host RAM only for the window's minutes (never on SSD nor in Redis).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

from storage.keys import Kind

_DAY_S = 24 * 3600.0
_CHUNKS = (Kind.CHUNK, Kind.CHUNK_24H)  # the chunks that may leave host RAM
_WINDOWS = (Kind.WINDOW, Kind.WINDOW_24H)
_IN_MEMORY = (Kind.CHUNK_IN_MEMORY, Kind.WINDOW_IN_MEMORY)


class TierName(str, enum.Enum):
    """A storage tier; the value appears in metrics and in the Redis location index."""

    RAM = "ram"
    SSD = "ssd"
    REDIS = "redis"


class FsyncPolicy(str, enum.Enum):
    """How hard an SSD write insists on durability before it counts as written.

    ``never`` is the default: this is a cache, and a file torn by a power cut fails
    its checksum and reads as a miss. ``file`` fsyncs the data before the rename;
    ``file+dir`` also fsyncs the directory so the rename itself survives a crash.
    """

    NEVER = "never"
    FILE = "file"
    FILE_AND_DIR = "file+dir"


def default_ram_capacity() -> int:
    """10% of this machine's physical memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 10


@dataclass(frozen=True)
class RetentionPolicy:
    """How much each tier holds and how long objects stay after their last use."""

    ram_capacity_bytes: int = field(default_factory=default_ram_capacity)
    chunk_retention_hours: float = 72.0
    window_ttl_minutes: float = 30.0
    persist_window_states: bool = False
    response_retention_hours: float = 72.0
    ssd_capacity_bytes: int | None = None  # None: until the disk is full
    fsync: FsyncPolicy = FsyncPolicy.NEVER
    # A read refreshes the on-disk (and Redis) last-use time at most this often; after
    # a restart an object's age is therefore over-estimated by at most this much.
    touch_interval_s: float = 60.0
    gc_interval_s: float = 600.0
    # Temp files of a live writer are younger than this; older ones are debris.
    temp_grace_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.ram_capacity_bytes < 0:
            raise ValueError("ram_capacity_bytes must be >= 0")
        if self.chunk_retention_hours <= 0 or self.window_ttl_minutes <= 0 or self.response_retention_hours <= 0:
            raise ValueError("retention times must be positive")

    def retention_s(self, kind: Kind, tier: TierName) -> float | None:
        """Seconds an object of ``kind`` stays in ``tier`` after its last use; None: never stored there."""
        if tier is TierName.RAM:
            return self.ram_retention_s(kind)
        if kind in (Kind.RESPONSE, Kind.CONVERSATION):
            return self.response_retention_hours * 3600.0
        if kind in _IN_MEMORY or (kind in _WINDOWS and not self.persist_window_states):
            return None
        return self._asked(kind, self.chunk_retention_hours * 3600.0)

    def ram_retention_s(self, kind: Kind) -> float:
        """Seconds an object of ``kind`` stays in host RAM after its last use (every kind lives there)."""
        if kind in _CHUNKS:
            return self._asked(kind, self.chunk_retention_hours * 3600.0)
        return self.window_ttl_minutes * 60.0

    @staticmethod
    def _asked(kind: Kind, seconds: float) -> float:
        """``seconds``, at most a day for the kinds whose request asked for 24 h."""
        return min(seconds, _DAY_S) if kind in (Kind.CHUNK_24H, Kind.WINDOW_24H) else seconds

    @property
    def longest_retention_s(self) -> float:
        """The longest any object is kept anywhere (the Redis index's key TTL)."""
        return max(self.chunk_retention_hours * 3600.0, self.response_retention_hours * 3600.0,
                   self.window_ttl_minutes * 60.0)
