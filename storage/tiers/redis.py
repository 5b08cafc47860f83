"""Redis object tier: chunk bytes shared by every node, for small deployments.

Each object is one hash ``{ns}:{kind}:{hex}`` with fields ``h`` (the 80-byte envelope
header), ``d`` (the payload, kept apart so that reads need no copy to split it) and
``t`` (last use, from the store's clock). The key's Redis TTL is the tier's retention,
refreshed with ``t``; the store's own clock decides expiry too (``t`` is checked on
read and by GC), so retention behaves the same under an injected clock. Reads and
writes of many objects share one pipelined round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import redis

from storage.codec import Codec, CorruptObject
from storage.keys import Kind, ObjectKey
from storage.metrics import TierCounters
from storage.policy import RetentionPolicy, TierName
from storage.redis_link import RedisLink
from storage.tiers.base import OnDrop, Tier

_SCAN_BATCH = 500


class RedisTier(Tier):
    """Verified objects in Redis; an unreachable Redis reads as misses and drops writes."""

    name = TierName.REDIS

    def __init__(self, link: RedisLink, codec: Codec, policy: RetentionPolicy, clock: Callable[[], float],
                 counters: TierCounters, on_drop: OnDrop) -> None:
        self._link = link
        self._codec = codec
        self._policy = policy
        self._clock = clock
        self._counters = counters
        self._on_drop = on_drop

    def _name(self, key: ObjectKey) -> str:
        return self._link.key(key.kind.name.lower(), key.hex)

    def _retention(self, kind: Kind) -> float | None:
        return self._policy.retention_s(kind, TierName.REDIS)

    def contains(self, key: ObjectKey) -> bool:
        return bool(self._link.run(lambda client: client.exists(self._name(key))))

    def get(self, key: ObjectKey) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[ObjectKey]) -> list[bytes | None]:
        def fetch(client: redis.Redis) -> list[list[bytes | None]]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hmget(self._name(key), ("h", "d", "t"))
            return pipe.execute()

        results: list[bytes | None] = [None] * len(keys)
        rows = self._link.run(fetch) if keys else []
        if rows is None:
            self._counters.add(misses=len(keys))
            return results
        now = self._clock()
        dead: list[tuple[ObjectKey, str]] = []
        touch: list[ObjectKey] = []
        hits = hit_bytes = 0
        for i, (key, (header, payload, used)) in enumerate(zip(keys, rows)):
            retention = self._retention(key.kind)
            if header is None or retention is None:
                continue
            try:
                last_used = float(used)
                self._codec.check_payload(self._codec.check_header(key, header), payload)
            except (CorruptObject, TypeError, ValueError):
                dead.append((key, "corrupt"))
                continue
            if now - last_used > retention:
                dead.append((key, "expirations"))
                continue
            if now - last_used >= self._policy.touch_interval_s:
                touch.append(key)
            results[i] = payload
            hits += 1
            hit_bytes += len(payload)
        if dead or touch:
            self._link.run(lambda client: self._cleanup(client, dead, touch, now))
        self._counters.add(hits=hits, misses=len(keys) - hits, bytes_read=hit_bytes,
                           corrupt=sum(reason == "corrupt" for _, reason in dead),
                           expirations=sum(reason == "expirations" for _, reason in dead))
        for key, _ in dead:
            self._on_drop(key)
        return results

    def _cleanup(self, client: redis.Redis, dead: Sequence[tuple[ObjectKey, str]],
                 touch: Sequence[ObjectKey], now: float) -> None:
        pipe = client.pipeline(transaction=False)
        for key, _ in dead:
            pipe.delete(self._name(key))
        for key in touch:
            pipe.hset(self._name(key), "t", repr(now))
            pipe.pexpire(self._name(key), int(1000 * self._retention(key.kind)))
        pipe.execute()

    def put(self, key: ObjectKey, payload: bytes) -> bool:
        return self.put_many([(key, payload)])[0]

    def put_many(self, items: Sequence[tuple[ObjectKey, bytes]]) -> list[bool]:
        """``put`` for each item in one pipelined round trip; all False if Redis is unreachable."""
        wanted = [(key, payload) for key, payload in items if self._retention(key.kind) is not None]
        now = repr(self._clock())

        def store(client: redis.Redis) -> bool:
            pipe = client.pipeline(transaction=False)
            for key, payload in wanted:
                name = self._name(key)
                pipe.hset(name, mapping={"h": self._codec.header(key, payload), "d": payload, "t": now})
                pipe.pexpire(name, int(1000 * self._retention(key.kind)))
            pipe.execute()
            return True

        stored = bool(wanted) and bool(self._link.run(store))
        if stored:
            self._counters.add(puts=len(wanted), bytes_written=sum(len(p) for _, p in wanted))
        elif wanted:
            self._counters.add(write_errors=len(wanted))
        done = {key for key, _ in wanted} if stored else set()
        return [key in done for key, _ in items]

    def remove(self, key: ObjectKey) -> bool:
        removed = bool(self._link.run(lambda client: client.delete(self._name(key))))
        if removed:
            self._on_drop(key)
        return removed

    def gc(self) -> None:
        """Delete objects unused for longer than their retention by the store's clock.

        Redis expires keys by its own clock as well; this pass is what makes an injected
        clock (tests) and a clock skewed from Redis's agree. It scans the namespace, so
        it costs O(objects in Redis): fine for the small deployments this tier is for.
        """
        now = self._clock()
        expired: list[ObjectKey] = []
        for kind in Kind:
            retention = self._retention(kind)
            names = self._link.run(lambda client: list(client.scan_iter(
                match=self._link.key(kind.name.lower(), "*"), count=_SCAN_BATCH)))
            for start in range(0, len(names or ()), _SCAN_BATCH):
                batch = names[start:start + _SCAN_BATCH]
                used = self._link.run(lambda client: self._last_used(client, batch))
                for name, last_used in zip(batch, used or ()):
                    if last_used is not None and (retention is None or now - last_used > retention):
                        expired.append(ObjectKey.from_hex(kind, name.decode().rsplit(":", 1)[1]))
        if expired:
            self._link.run(lambda client: client.delete(*(self._name(key) for key in expired)))
        self._counters.add(expirations=len(expired))
        for key in expired:
            self._on_drop(key)

    @staticmethod
    def _last_used(client: redis.Redis, names: Sequence[bytes]) -> list[float | None]:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.hget(name, "t")
        values = pipe.execute()
        result: list[float | None] = []
        for value in values:
            try:
                result.append(float(value))
            except (TypeError, ValueError):
                result.append(None)
        return result

    def close(self) -> None:
        """The link belongs to the store, which closes it."""
