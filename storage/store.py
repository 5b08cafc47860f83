"""TieredStore: the one object the prefill and decoder pools read and write cache bytes through.

    put   -> host RAM now; SSD (and Redis, if it stores bytes) on the write-behind thread
    get   -> RAM, then queued writes, then SSD, then Redis; a lower hit is promoted to RAM
             (concurrent reads of one key from a lower tier share one read)
    lookup_prefix -> the longest run of stored chunks, and where each one lives

Every tier returns verified bytes or a miss, so the store never returns wrong bytes and
never raises for storage trouble: a dead Redis, a full disk, a torn file all degrade to
misses (and counters). Retention runs on an injectable clock; GC runs on a background
thread every ``gc_interval_s`` and on demand.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

from storage.codec import Codec
from storage.index import SHARED_NODE, IndexPublisher, Location, RedisIndex
from storage.keys import Fingerprint, Kind, ObjectKey
from storage.metrics import StoreStats, TierCounters
from storage.policy import RetentionPolicy, TierName
from storage.redis_link import RedisLink
from storage.ram_tier import RamTier
from storage.redis_tier import RedisTier
from storage.ssd_tier import SizedSsdTier, SsdTier, WriteFile, write_all
from storage.write_behind import WriteBehind, WriteJob

logger = logging.getLogger(__name__)

_LOOKUP_BATCH = 256  # keys per Redis round trip in lookup_prefix
_RAM, _SSD, _REDIS = TierName.RAM, TierName.SSD, TierName.REDIS  # an enum member by attribute costs ~60 ns


@dataclass(frozen=True)
class StoreConfig:
    """Where a node's store keeps things. ``ssd_dir``/``redis_url`` None turn that tier off."""

    node_id: str
    ssd_dir: Path | None = None
    redis_url: str | None = None  # redis://:password@host:port/db, or rediss:// for TLS
    redis_stores_bytes: bool = False  # also keep object bytes in Redis (small deployments)
    redis_namespace: str = "v41"
    redis_timeout_s: float = 0.5
    redis_retry_s: float = 1.0  # after a failure, skip Redis this long before trying again
    index_heartbeat_s: float = 2.0  # how often the index publisher checks in with Redis
    index_pending_max: int = 100_000  # queued index updates kept while Redis is away
    write_queue_bytes: int = 256 << 20
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    # The retention lab drives a store on a virtual clock: GC when it says, lower tiers
    # written on the caller's thread, and optionally sizes instead of bytes on SSD.
    gc_thread: bool = True
    write_behind: bool = True
    ssd_sizes_only: bool = False

    def __post_init__(self) -> None:
        if not self.node_id or "|" in self.node_id or self.node_id == SHARED_NODE:
            raise ValueError(f"invalid node id {self.node_id!r}")


@dataclass(frozen=True)
class ChunkHit:
    """A stored chunk of a prefix and every known copy of it (this node's first)."""

    key: ObjectKey
    locations: tuple[Location, ...]


@dataclass(frozen=True)
class PrefixMatch:
    """The longest stored prefix of a key sequence, chunk by chunk."""

    hits: tuple[ChunkHit, ...]

    @property
    def chunks(self) -> int:
        return len(self.hits)


class TieredStore:
    """Host RAM + SSD + Redis for one node and one model fingerprint. Thread-safe."""

    def __init__(self, config: StoreConfig, fingerprint: Fingerprint, *,
                 clock: Callable[[], float] = time.time, ssd_write: WriteFile = write_all,
                 on_drop: Callable[[ObjectKey, Location], None] | None = None,
                 drops_from: Collection[TierName] = tuple(TierName), secret: bytes | None = None) -> None:
        """``on_drop``: told of every copy a tier in ``drops_from`` lets go (evicted,
        expired, corrupt, removed), with where it was. ``secret``: the cluster's, which
        keys every object's MAC (:mod:`storage.codec`; None: the fingerprint does)."""
        self.config = config
        self._on_drop = on_drop
        self._drops_from = frozenset(drops_from)
        self._policy = config.retention
        # Seconds per tier and kind, for the kinds each tier keeps.
        self._retention: dict[TierName, dict[Kind, float]] = {
            tier: {kind: retention for kind in Kind if (retention := self._policy.retention_s(kind, tier)) is not None}
            for tier in TierName}
        # The kinds each lower tier takes (a set of ints: the write path's test, without enum look-ups).
        self._lower_kinds = {tier: frozenset(self._retention[tier]) for tier in (TierName.SSD, TierName.REDIS)}
        self._clock = clock
        self._codec = Codec(fingerprint, secret)
        self._counters = {tier: TierCounters() for tier in TierName}
        self._gc_runs = 0
        self._here = {tier: Location(config.node_id, tier) for tier in (TierName.RAM, TierName.SSD)}
        self._shared = Location(SHARED_NODE, TierName.REDIS)

        self._link: RedisLink | None = None
        self._index: RedisIndex | None = None
        self._publisher: IndexPublisher | None = None
        self._redis: RedisTier | None = None
        if config.redis_url is not None:
            self._link = RedisLink(config.redis_url, namespace=config.redis_namespace,
                                   timeout_s=config.redis_timeout_s, retry_s=config.redis_retry_s)
            self._index = RedisIndex(self._link, self._policy.longest_retention_s)
            if config.redis_stores_bytes:
                self._redis = RedisTier(self._link, self._codec, self._policy, clock,
                                        self._counters[TierName.REDIS], self._dropped(self._shared))

        # A RAM tier whose drops nobody hears (no index, no listener) builds no key per eviction.
        ram_listened = self._index is not None or (on_drop is not None and TierName.RAM in drops_from)
        self._ram = RamTier(self._policy, clock, self._counters[TierName.RAM],
                            self._dropped(self._here[TierName.RAM]) if ram_listened else None)
        self._ssd = None
        if config.ssd_dir is not None:
            tier = SizedSsdTier if config.ssd_sizes_only else SsdTier
            self._ssd = tier(config.ssd_dir, self._codec, self._policy, clock, self._counters[TierName.SSD],
                                self._dropped(self._here[TierName.SSD]), ssd_write)
        if self._index is not None:
            self._publisher = IndexPublisher(
                self._index, clock, self._local_entries, max_pending=config.index_pending_max,
                touch_interval_s=self._policy.touch_interval_s, heartbeat_s=config.index_heartbeat_s)
        self._writer = WriteBehind(self._write_lower, max_bytes=config.write_queue_bytes)
        # Keys being read from the SSD or Redis now: (the reading call's event, its results,
        # the key's index in them).
        self._reading: dict[ObjectKey, tuple[threading.Event, list, int]] = {}
        self._reading_lock = threading.Lock()
        self._closed = threading.Event()
        self._gc_thread = threading.Thread(target=self._gc_loop, name="v41-store-gc", daemon=True)
        if config.gc_thread:
            self._gc_thread.start()

    # -- index bookkeeping -------------------------------------------------------------

    def _dropped(self, location: Location) -> Callable[[ObjectKey], None]:
        def on_drop(key: ObjectKey) -> None:
            if self._publisher is not None:
                self._publisher.removed(key, location)
            if self._on_drop is not None and location.tier in self._drops_from:
                self._on_drop(key, location)
        return on_drop

    def _publish(self, key: ObjectKey, location: Location) -> None:
        """Tell the index that a copy was stored at ``location`` (callers check that there is one)."""
        assert self._publisher is not None
        self._publisher.added(key, location, self._clock() + self._retention[location.tier][key.kind])

    def _local_entries(self) -> Iterator[tuple[ObjectKey, Location, float]]:
        for tier in (self._ram, self._ssd):
            if tier is not None:
                for key, expires in tier.entries():
                    yield key, self._here[tier.name], expires

    # -- writes ------------------------------------------------------------------------

    def put(self, key: ObjectKey, payload: bytes | bytearray | memoryview, *, replace: bool = False) -> None:
        """Store ``payload`` under ``key``. Returns at once; lower tiers are written behind.

        Never raises for storage trouble. Window states go to RAM only unless the
        policy persists them. The bytes are copied only if they are not ``bytes``.
        ``replace``: the key now stands for other bytes (the retention lab grows an
        extent under one key), so the SSD rewrites a copy it holds instead of keeping it.
        A conversation's key always stands for its newest version: always replaced.
        """
        data = payload if isinstance(payload, bytes) else bytes(payload)
        replace = replace or key.kind is Kind.CONVERSATION
        if self._ram.put(key, data) and self._publisher is not None:
            self._publish(key, self._here[_RAM])
        self._write_behind(key, data, to_redis=True, replace=replace)

    def _write_behind(self, key: ObjectKey, data: bytes, *, to_redis: bool, replace: bool = False) -> None:
        to_ssd = self._ssd is not None and key.kind in self._lower_kinds[_SSD]
        to_redis = to_redis and self._redis is not None and key.kind in self._lower_kinds[_REDIS]
        if not (to_ssd or to_redis):
            return
        if self.config.write_behind:
            if not self._writer.submit(WriteJob(key, data, to_ssd, to_redis, replace)):
                self._counters[TierName.SSD if to_ssd else TierName.REDIS].add(write_errors=1)
            return
        if to_ssd:  # on the caller's thread (the retention lab: no job to build)
            self._write_ssd(key, data, replace)
        if to_redis:
            self._write_lower([WriteJob(key, data, False, True)])

    def _write_ssd(self, key: ObjectKey, payload: bytes, replace: bool = False) -> None:
        assert self._ssd is not None
        if self._ssd.put(key, payload, replace) and self._publisher is not None:
            self._publish(key, self._here[_SSD])

    def _write_lower(self, jobs: Sequence[WriteJob]) -> None:
        """The write-behind sink: files one by one, Redis in one pipeline."""
        for job in jobs:
            if job.to_ssd:
                self._write_ssd(job.key, job.payload, job.replace)
        shared = [(job.key, job.payload) for job in jobs if job.to_redis]
        if shared:
            assert self._redis is not None
            for (key, _), stored in zip(shared, self._redis.put_many(shared)):
                if stored and self._publisher is not None:
                    self._publish(key, self._shared)

    def remove(self, key: ObjectKey) -> None:
        """Delete ``key`` from every tier (a queued write may still land: remove after ``flush``)."""
        for tier in (self._ram, self._ssd, self._redis):
            if tier is not None:
                tier.remove(key)

    # -- reads -------------------------------------------------------------------------

    def get(self, key: ObjectKey) -> bytes | None:
        """The exact bytes stored under ``key``, or None. Never raises for storage trouble."""
        return self.get_many((key,))[0]

    def get_many(self, keys: Sequence[ObjectKey]) -> list[bytes | None]:
        """``get`` for each key, in order: the way to read a prefix's chunks. Each tier
        is asked once for all the keys still missing (RAM under one lock, Redis in one
        round trip)."""
        results = self._ram.get_many(keys)
        if self._publisher is not None:
            self._published_use(TierName.RAM, [key for key, payload in zip(keys, results) if payload is not None])
        if None not in results:  # all in RAM: the hot path
            return results
        missing = [i for i, payload in enumerate(results) if payload is None]
        # Written but not yet on the lower tiers.
        for i, payload in zip(missing, self._writer.pending_many([keys[i] for i in missing])):
            results[i] = payload
        missing = [i for i in missing if results[i] is None]
        if missing and (self._ssd is not None or self._redis is not None):
            self._read_lower(keys, results, missing)
        return results

    def _read_lower(self, keys: Sequence[ObjectKey], results: list[bytes | None], missing: list[int]) -> None:
        """Fill ``results[i]`` for ``missing`` from the SSD, then Redis, promoting each hit
        to RAM. A key another thread is already reading from them is waited for, not read
        again: a decoder's prefetch and the prefill of the same turn cost one disk read
        (and count one hit). A reader finishes its own keys before it waits for others',
        so two readers of overlapping keys never wait on each other."""
        own: list[int] = []
        theirs: list[tuple[int, tuple[threading.Event, list, int]]] = []
        done = threading.Event()  # one for this call's keys: set when all of them are read
        with self._reading_lock:
            for i in missing:
                flight = self._reading.get(keys[i])
                if flight is None:
                    self._reading[keys[i]] = (done, results, i)
                    own.append(i)
                else:
                    theirs.append((i, flight))
        try:
            pending = own
            for tier in (self._ssd, self._redis):
                pending = [i for i in pending if results[i] is None]
                if tier is None or not pending:
                    continue
                found = tier.get_many([keys[i] for i in pending])
                hits = [(i, payload) for i, payload in zip(pending, found) if payload is not None]
                self._published_use(tier.name, [keys[i] for i, _ in hits])
                for i, payload in hits:
                    results[i] = payload
                    self._promote(keys[i], payload)
                    if tier is self._redis:
                        self._write_behind(keys[i], payload, to_redis=False)
        finally:
            with self._reading_lock:
                for i in own:
                    del self._reading[keys[i]]
            done.set()
        for i, (read, their_results, at) in theirs:
            read.wait()
            results[i] = their_results[at]

    def read_prefix(self, keys: Sequence[ObjectKey]) -> list[tuple[bytes, TierName]]:
        """Read the longest prefix of ``keys`` this node holds: per key read, its payload
        and the tier it came from. What ``lookup_prefix`` (this node's copies) and then
        ``get_many`` of the hits do, in one pass: RAM first under one lock round, a key
        RAM misses from the queued writes or the SSD (promoted to RAM), and the first key
        found nowhere ends it."""
        out: list[tuple[bytes, TierName]] = []
        while len(out) < len(keys):
            start = len(out)
            rest = keys[start:] if start else keys
            found = self._ram.get_many(rest, prefix=True)  # (hits only: no None)
            out += [(cast(bytes, payload), _RAM) for payload in found]
            if self._publisher is not None:
                self._published_use(_RAM, rest[: len(found)])
            if len(out) == len(keys):
                break
            key = keys[len(out)]
            payload = self._writer.pending(key)
            if payload is not None:
                out.append((payload, _RAM))
                continue
            payload = self._ssd.get(key) if self._ssd is not None else None
            if payload is None:
                break
            self._published_use(_SSD, [key])
            self._promote(key, payload)
            out.append((payload, _SSD))
        return out

    def _published_use(self, tier: TierName, keys: Sequence[ObjectKey]) -> None:
        """Tell the index that copies in ``tier`` were read (their retention restarted)."""
        if self._publisher is None or not keys:
            return
        now = self._clock()
        retention = self._retention[tier]
        location = self._shared if tier is TierName.REDIS else self._here[tier]
        self._publisher.used([(key, now + retention[key.kind]) for key in keys], location)

    def _promote(self, key: ObjectKey, payload: bytes) -> None:
        if self._ram.put(key, payload) and self._publisher is not None:
            self._publish(key, self._here[_RAM])

    def lookup_prefix(self, keys: Sequence[ObjectKey]) -> PrefixMatch:
        """The longest prefix of ``keys`` stored anywhere, with every known copy of each chunk.

        This node's copies come from its own tiers (exact); other nodes' come from the
        Redis index (a routing hint: a copy may have gone since). With Redis away the
        answer covers this node only. Reads no payload and restarts no retention clock.
        """
        hits: list[ChunkHit] = []
        now = self._clock()
        for start in range(0, len(keys), _LOOKUP_BATCH):
            batch = keys[start:start + _LOOKUP_BATCH]
            remote = self._index.locate(batch, now) if self._index is not None else None
            for i, key in enumerate(batch):
                locations = [self._here[TierName.RAM]] if (
                    self._ram.contains(key) or self._writer.pending(key) is not None) else []
                if self._ssd is not None and self._ssd.contains(key):
                    locations.append(self._here[TierName.SSD])
                if remote is not None:
                    locations += [loc for loc in remote[i] if loc.node_id != self.config.node_id]
                if not locations:
                    return PrefixMatch(tuple(hits))
                hits.append(ChunkHit(key, tuple(locations)))
        return PrefixMatch(tuple(hits))

    # -- maintenance -------------------------------------------------------------------

    def gc(self) -> None:
        """Remove every object whose retention has run out, from every tier, and write debris."""
        for tier in (self._ram, self._ssd, self._redis):
            if tier is not None:
                tier.gc()
        self._gc_runs += 1

    def _gc_loop(self) -> None:
        """``gc`` every interval until closed. A run that raises (a bug, or data no tier
        foresaw) is logged and the next one runs as planned: a dead GC thread would let
        every tier grow past its retention for the rest of the process's life."""
        while not self._closed.wait(self._policy.gc_interval_s):
            try:
                self.gc()
            except Exception:
                logger.exception("store GC run failed; the next runs in %s s", self._policy.gc_interval_s)

    def publish(self) -> bool:
        """Send queued index updates now (the request path pays one Redis round trip or
        two); True when Redis holds this node's current state, False without Redis."""
        return self._publisher.flush() if self._publisher is not None else False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued writes, then send queued index updates; True if both are done."""
        written = self._writer.flush(timeout)
        published = self._publisher.flush() if self._publisher is not None else True
        return written and published

    def sized_state(self) -> dict:
        """What a store of sizes only (``ssd_sizes_only``, no Redis) holds, as plain rows
        and numbers: the retention lab checkpoints it (no pickle). ``ram`` and ``ssd``
        are (objects, their rows one at a time): a checkpoint of tens of millions of
        objects streams them rather than holding a copy."""
        if not self.config.ssd_sizes_only or self._redis is not None:
            raise ValueError("only a store of sizes (ssd_sizes_only, no Redis) has a sized state")
        return {"ram": (self._ram.usage()[0], self._ram.sized_state()),
                "ssd": (ssd.usage()[0], ssd.sized_state()) if isinstance(ssd := self._ssd, SizedSsdTier)
                else (0, iter(())),
                "counters": {tier.value: asdict(c.snapshot()) for tier, c in self._counters.items()},
                "gc_runs": self._gc_runs}

    def restore_sized(self, state: dict) -> None:
        """Take back a :meth:`sized_state` into this empty store (``ram`` and ``ssd``:
        iterables of rows)."""
        if not self.config.ssd_sizes_only or self.stats().objects.get("ram"):
            raise ValueError("a sized state goes into an empty store of sizes")
        self._ram.restore_sized(state["ram"])
        if isinstance(self._ssd, SizedSsdTier):
            self._ssd.restore_sized(state["ssd"])
        for tier, values in state["counters"].items():
            self._counters[TierName(tier)].add(**values)
        self._gc_runs = state["gc_runs"]

    @property
    def ssd_verifies_mac(self) -> bool:
        """Whether SSD reads check the keyed MAC (a cache folder others could write), not
        the checksum (a private one; storage/ssd_tier.py). False without an SSD tier."""
        return self._ssd is not None and self._ssd.verifies_mac

    def stats(self) -> StoreStats:
        """A snapshot of every counter."""
        objects, stored = {}, {}
        for tier in (self._ram, self._ssd):
            if tier is not None:
                objects[tier.name.value], stored[tier.name.value] = tier.usage()
        return StoreStats(
            tiers={tier.value: counters.snapshot() for tier, counters in self._counters.items()},
            objects=objects,
            bytes_stored=stored,
            gc_runs=self._gc_runs,
            index_pending=self._publisher.pending if self._publisher is not None else 0,
            index_resyncs=self._publisher.resyncs if self._publisher is not None else 0,
            redis_errors=self._link.errors if self._link is not None else 0,
            redis_up=self._link.up if self._link is not None else False,
        )

    def close(self) -> None:
        """Finish queued writes and index updates (if Redis is up), stop threads, release tiers."""
        self._closed.set()
        if self._gc_thread.is_alive():
            self._gc_thread.join()
        self._writer.close()
        if self._publisher is not None:
            self._publisher.close()
        for tier in (self._ram, self._ssd, self._redis):
            if tier is not None:
                tier.close()
        if self._link is not None:
            self._link.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
