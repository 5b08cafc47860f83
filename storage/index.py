"""The cluster-wide location index in Redis: which object lives on which node and tier.

Each object key has one sorted set ``{ns}:loc:{hex}``; a member ``node|tier`` says the
object lives there, and its score is when that copy's retention runs out (by the
store's clock). Readers ignore members whose score has passed; writers trim them; the
set's own Redis TTL is the longest retention of any tier, so a forgotten set vanishes.
(One string key per copy would need a SCAN to find an object's copies, and hash fields
have no TTL before Redis 7.4.)

``IndexPublisher`` queues a node's updates, coalesced per (object, tier) and bounded,
and a background thread sends them in pipelined batches; the one write on the request
path is a finished conversation's, flushed at once (one round trip) so that the next
turn finds it. While Redis is unreachable the queue keeps the latest state; if it
overflows, or Redis comes back empty (a new server run id), the node republishes
everything it holds.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import redis

from storage.keys import ObjectKey
from storage.policy import TierName
from storage.redis_link import RedisLink

SHARED_NODE = "*"  # the node id of copies every node can read (the Redis object tier)


@dataclass(frozen=True, order=True)
class Location:
    """One copy of an object: the node that holds it and in which tier."""

    node_id: str
    tier: TierName

    @property
    def member(self) -> str:
        return f"{self.node_id}|{self.tier.value}"

    @classmethod
    def from_member(cls, member: str) -> Location | None:
        node_id, _, tier = member.rpartition("|")
        try:
            return cls(node_id, TierName(tier))
        except ValueError:
            return None  # written by a newer version: ignore, never fail a lookup


@dataclass(frozen=True)
class IndexUpdate:
    """Set (``expires`` given) or delete (``expires`` None) one copy's index entry."""

    hex: str
    location: Location
    expires: float | None


# ``locate`` in one command: the live members of every key, in order. One EVALSHA
# instead of a pipeline of ZRANGEBYSCOREs halves a lookup of 68 keys (1.19 -> 0.54 ms
# here) and is what the router pays before every request.
_LOCATE = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('ZRANGEBYSCORE', key, ARGV[1], '+inf') end
return out
"""


class RedisIndex:
    """Reads and writes location entries; every method returns None when Redis is unreachable."""

    def __init__(self, link: RedisLink, key_ttl_s: float) -> None:
        self._link = link
        self._key_ttl_ms = int(1000 * key_ttl_s)
        self._locate_script = link.client.register_script(_LOCATE)
        self._scripting = True  # False once the server refuses scripts (an ACL): pipelines then

    def _name(self, hex_digest: str) -> str:
        return self._link.key("loc", hex_digest)

    def apply(self, updates: Sequence[IndexUpdate], now: float) -> bool | None:
        """Write ``updates`` in one pipeline; True when done, None when Redis is unreachable."""
        if not updates:
            return True
        return None if self.apply_and_identify(updates, now) is None else True

    def apply_and_identify(self, updates: Sequence[IndexUpdate], now: float) -> str | None:
        """Write ``updates`` and ask the server's run id, in one round trip: the run id
        (which changes when Redis restarts and forgets everything), or None when Redis
        is unreachable."""
        def write(client: redis.Redis) -> str:
            pipe = client.pipeline(transaction=False)
            for update in updates:
                name = self._name(update.hex)
                if update.expires is None:
                    pipe.zrem(name, update.location.member)
                else:
                    pipe.zadd(name, {update.location.member: update.expires})
                    pipe.zremrangebyscore(name, "-inf", now)
                    pipe.pexpire(name, self._key_ttl_ms)
            pipe.info("server")
            return str(pipe.execute()[-1]["run_id"])

        return self._link.run(write)

    def forget_nodes(self, node_ids: Sequence[str], batch: int = 1000) -> int | None:
        """Drop every copy the index lists on ``node_ids`` (dead nodes: their RAM is gone,
        and a host that rejoins is a new node that publishes what its disk kept): the
        number of entries dropped, or None when Redis is unreachable. One SCAN over the
        index, a pipelined ZREM per ``batch`` keys."""
        members = [Location(node_id, tier).member for node_id in node_ids for tier in TierName
                   if tier is not TierName.REDIS]

        def drop(client: redis.Redis) -> int:
            dropped = 0
            names = []
            for name in client.scan_iter(match=self._link.key("loc", "*"), count=batch):
                names.append(name)
                if len(names) == batch:
                    dropped += self._zrem(client, names, members)
                    names = []
            return dropped + self._zrem(client, names, members)

        return self._link.run(drop) if members else 0

    @staticmethod
    def _zrem(client: redis.Redis, names: list, members: list[str]) -> int:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.zrem(name, *members)
        return sum(pipe.execute()) if names else 0

    def locate(self, keys: Sequence[ObjectKey], now: float) -> list[tuple[Location, ...]] | None:
        """The live copies of each key, in order; None when Redis is unreachable."""
        def read(client: redis.Redis) -> list[list[bytes]]:
            if self._scripting and keys:
                try:
                    return self._locate_script(keys=[self._name(key.hex) for key in keys], args=[now], client=client)
                except redis.ResponseError:  # (a flushed script is reloaded by redis-py itself)
                    self._scripting = False
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.zrangebyscore(self._name(key.hex), now, "+inf")
            return pipe.execute()

        rows = self._link.run(read)
        if rows is None:
            return None
        result = []
        for members in rows:
            # (a member that is not UTF-8, planted or garbled, is no location: no lookup fails on it)
            locations = (Location.from_member(member.decode("utf-8", "replace")) for member in members)
            result.append(tuple(sorted(location for location in locations if location is not None)))
        return result

Snapshot = Callable[[], Iterable[tuple[ObjectKey, Location, float]]]


class IndexPublisher:
    """Queues this node's index updates and sends them from a background thread."""

    def __init__(self, index: RedisIndex, clock: Callable[[], float], snapshot: Snapshot,
                 *, max_pending: int, touch_interval_s: float, heartbeat_s: float) -> None:
        self._index = index
        self._clock = clock
        self._snapshot = snapshot
        self._max_pending = max_pending
        self._touch_interval_s = touch_interval_s
        self._heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._pending: OrderedDict[tuple[str, Location], float | None] = OrderedDict()
        self._published: dict[tuple[str, Location], float] = {}  # when each live entry was last sent
        # Updates were dropped, or never sent (a store reopened on its files): republish all.
        self._lost = True
        self._server: str | None = None
        self.resyncs = 0
        self._wake = threading.Event()
        self._closed = False
        self._flush_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="v41-index-publisher", daemon=True)
        self._thread.start()

    # -- recording (request path: memory only) -----------------------------------------

    def _record(self, hex_digest: str, location: Location, expires: float | None) -> None:
        with self._lock:
            slot = (hex_digest, location)
            self._pending.pop(slot, None)
            self._pending[slot] = expires
            if expires is None:
                self._published.pop(slot, None)
            else:
                self._published[slot] = self._clock()
            if len(self._pending) > self._max_pending:
                self._pending.popitem(last=False)
                self._lost = True
        self._wake.set()

    def added(self, key: ObjectKey, location: Location, expires: float) -> None:
        """A copy was stored (or its retention restarted) and lasts until ``expires``."""
        self._record(key.hex, location, expires)

    def used(self, copies: Sequence[tuple[ObjectKey, float]], location: Location) -> None:
        """Copies at ``location`` were read (key, new expiry): republish each expiry, at
        most once per touch interval, so hot objects cost Redis nothing per read."""
        now = self._clock()
        with self._lock:
            stale = [(key.hex, expires) for key, expires in copies
                     if now - self._published.get((key.hex, location), -math.inf) >= self._touch_interval_s]
        for hex_digest, expires in stale:
            self._record(hex_digest, location, expires)

    def removed(self, key: ObjectKey, location: Location) -> None:
        """A copy is gone."""
        self._record(key.hex, location, None)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    # -- sending (background thread, or ``flush`` from the caller) ---------------------

    def flush(self) -> bool:
        """Send what is queued now; True when Redis holds this node's current state.

        The queued updates and the server's run id go in one round trip (a finished
        request waits for this); only when Redis is new to this node (a restart, or
        updates were dropped) does a second one republish everything it holds."""
        with self._flush_lock:
            with self._lock:
                batch = list(self._pending.items())
                self._pending.clear()
                lost, self._lost = self._lost, False
            now = self._clock()
            updates = [IndexUpdate(hex_digest, location, expires) for (hex_digest, location), expires in batch]
            server = self._index.apply_and_identify(updates, now)
            resync = server is not None and (lost or server != self._server)
            if resync:
                sent = {(u.hex, u.location) for u in updates}
                again = [IndexUpdate(key.hex, location, expires) for key, location, expires in self._snapshot()
                         if (key.hex, location) not in sent and expires > now]
                if self._index.apply(again, now) is None:
                    server = None
            if server is None:
                with self._lock:
                    for slot, expires in batch:  # newer records win over the failed batch
                        if slot not in self._pending:
                            self._pending[slot] = expires
                            self._pending.move_to_end(slot, last=False)
                    self._lost = self._lost or lost or resync or len(self._pending) > self._max_pending
                    while len(self._pending) > self._max_pending:
                        self._pending.popitem(last=False)
                return False
            with self._lock:
                self._server = server
                self.resyncs += int(resync)
            return True

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self._heartbeat_s)
            self._wake.clear()
            if not self._closed:
                self.flush()

    def close(self) -> None:
        """Send what is queued (if Redis is up) and stop the thread."""
        self._closed = True
        self._wake.set()
        self._thread.join()
        self.flush()
