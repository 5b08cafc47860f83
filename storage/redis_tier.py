"""Redis object tier: chunk bytes shared by every node, for small deployments.

Each object is one string ``{ns}:{kind}:{hex}``: its last use (8 bytes, float64 LE,
from the store's clock) followed by the envelope (88-byte header and payload). One
string per object lets a batch of reads be one ``MGET``, which redis-py sends and
parses several times faster than a pipeline of per-object commands. The key's Redis
TTL is the tier's retention, refreshed with the last use (``SETRANGE`` of the first 8
bytes, outside the checksummed envelope, then ``PEXPIRE``); the store's own clock
decides expiry too (the last use is checked on read and by GC), so retention behaves
the same under an injected clock. Writes of many objects share one pipelined round trip.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable, Sequence

import redis

from storage.codec import Codec, CorruptObject
from storage.keys import Kind, ObjectKey
from storage.metrics import TierCounters
from storage.policy import RetentionPolicy, TierName
from storage.redis_link import RedisLink
from storage.tier import OnDrop, Tier

logger = logging.getLogger(__name__)

_SCAN_BATCH = 500
_UNPARSED_LOGGED = 1000  # names GC warned about once each; past that, skipped quietly
_USED = struct.Struct("<d")  # last use, by the store's clock, in front of the envelope


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
        self._retention_s = {kind: policy.retention_s(kind, TierName.REDIS) for kind in Kind}  # None: not kept
        self._unparsed: set[bytes] = set()  # names GC could not parse, already logged

    def _name(self, key: ObjectKey) -> str:
        return self._link.key(key.kind.name.lower(), key.hex)

    def _retention(self, kind: Kind) -> float | None:
        return self._retention_s[kind]

    def contains(self, key: ObjectKey) -> bool:
        return bool(self._link.run(lambda client: client.exists(self._name(key))))

    def get(self, key: ObjectKey) -> bytes | None:
        return self.get_many((key,))[0]

    def get_many(self, keys: Sequence[ObjectKey]) -> list[bytes | None]:
        results: list[bytes | None] = [None] * len(keys)
        if not keys:
            return results
        values = self._link.run(lambda client: client.mget([self._name(key) for key in keys]))
        if values is None:
            self._counters.add(misses=len(keys))
            return results
        now = self._clock()
        check = self._codec.check
        retention_s = self._retention_s
        touch_interval = self._policy.touch_interval_s
        dead: list[tuple[ObjectKey, str]] = []
        touch: list[ObjectKey] = []
        hits = hit_bytes = 0
        for i, key in enumerate(keys):
            value = values[i]
            if value is None:
                continue
            values[i] = None  # freed after the copy below: the next copy reuses its memory
            retention = retention_s[key.kind]
            try:
                (last_used,) = _USED.unpack_from(value)
                payload = check(key, value, _USED.size).tobytes()
            except (CorruptObject, struct.error):
                dead.append((key, "corrupt"))
                continue
            if retention is None or not now - last_used <= retention:  # NaN: expired
                dead.append((key, "expirations"))
                continue
            if now - last_used >= touch_interval:
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
            # SETRANGE on a key deleted meanwhile leaves an 8-byte string; PEXPIRE bounds
            # its life, and a read or GC deletes it sooner (too short to be an object).
            pipe.setrange(self._name(key), 0, _USED.pack(now))
            pipe.pexpire(self._name(key), int(1000 * self._retention(key.kind)))
        pipe.execute()

    def put(self, key: ObjectKey, payload: bytes) -> bool:
        return self.put_many([(key, payload)])[0]

    def put_many(self, items: Sequence[tuple[ObjectKey, bytes]]) -> list[bool]:
        """``put`` for each item in one pipelined round trip; all False if Redis is unreachable."""
        wanted = [(key, payload) for key, payload in items if self._retention(key.kind) is not None]
        used = _USED.pack(self._clock())

        def store(client: redis.Redis) -> bool:
            pipe = client.pipeline(transaction=False)
            for key, payload in wanted:
                value = b"".join((used, self._codec.header(key, payload), payload))
                pipe.set(self._name(key), value, px=int(1000 * self._retention(key.kind)))
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
            prefix = self._link.key(kind.name.lower(), "")
            names = self._link.run(lambda client: list(client.scan_iter(match=prefix + "*", count=_SCAN_BATCH)))
            for start in range(0, len(names or ()), _SCAN_BATCH):
                batch = names[start:start + _SCAN_BATCH]
                used = self._link.run(lambda client: self._last_used(client, batch))
                for name, last_used in zip(batch, used or ()):
                    if last_used is not None and (retention is None or not now - last_used <= retention):
                        key = self._parse(kind, prefix, name)
                        if key is not None:
                            expired.append(key)
        if expired:
            self._link.run(lambda client: client.delete(*(self._name(key) for key in expired)))
        self._counters.add(expirations=len(expired))
        for key in expired:
            self._on_drop(key)

    def _parse(self, kind: Kind, prefix: str, name: bytes) -> ObjectKey | None:
        """The key a Redis name under ``prefix`` holds, or None for a name that holds
        none (not ``prefix`` and 64 lowercase hex digits, as ``_name`` writes them:
        another program's, or planted), which GC leaves alone: one bad name must not
        stop the pass, nor every pass after it. Each is logged once."""
        text = name.decode("utf-8", "replace")
        digits = text[len(prefix):] if text.startswith(prefix) else ""
        try:
            key = ObjectKey.from_hex(kind, digits)
        except ValueError:
            key = None
        if key is not None and key.hex == digits:  # (an upper-case twin would drop the real key's index entry)
            return key
        if name not in self._unparsed and len(self._unparsed) < _UNPARSED_LOGGED:
            self._unparsed.add(name)
            logger.warning("redis tier GC skips %r: not a %s key", text, kind.name.lower())
        return None

    @staticmethod
    def _last_used(client: redis.Redis, names: Sequence[bytes]) -> list[float | None]:
        """Each object's last use; NaN for a value that is no object (debris), None if gone."""
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.getrange(name, 0, _USED.size - 1)
        result: list[float | None] = []
        for value in pipe.execute(raise_on_error=False):  # a hash of format 1 answers WRONGTYPE
            if value == b"":
                result.append(None)  # gone since the scan
            elif isinstance(value, bytes) and len(value) == _USED.size:
                result.append(_USED.unpack(value)[0])
            else:
                result.append(math.nan)
        return result

    def close(self) -> None:
        """The link belongs to the store, which closes it."""
