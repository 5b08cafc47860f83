"""The Redis location index's lookup: live copies of every key, in order, in one command
(a Lua script), and the same answer through a pipeline where the server refuses scripts."""

from __future__ import annotations

import time

import pytest
import redis

from storage.index import IndexUpdate, Location, RedisIndex
from storage.keys import Fingerprint, chunk_keys
from storage.policy import TierName
from storage.redis_link import RedisLink
from storage.redis_server import RedisServer
from tests.redis_server import redis_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

KEYS = chunk_keys(Fingerprint.of("tiny", {"layers": 4}), range(64 * 5), 64)


def _index(url: str, namespace: str) -> RedisIndex:
    return RedisIndex(RedisLink(url, namespace=namespace, timeout_s=1, retry_s=0), key_ttl_s=3600)


def _fill(index: RedisIndex, now: float) -> list[tuple[Location, ...]]:
    """Copies with live and expired entries; returns what ``locate`` must answer."""
    a, b, c = Location("n1", TierName.RAM), Location("n2", TierName.SSD), Location("*", TierName.REDIS)
    updates = [IndexUpdate(KEYS[0].hex, b, now + 60), IndexUpdate(KEYS[0].hex, a, now + 60),
               IndexUpdate(KEYS[2].hex, c, now + 3600), IndexUpdate(KEYS[3].hex, a, now + 60)]
    assert index.apply(updates, now)
    # An entry whose retention ran out is filtered by the reader (the writer has not trimmed it yet).
    index._link.client.zadd(index._name(KEYS[3].hex), {b.member: now - 1})
    return [(a, b), (), (c,), (a,), ()]


def test_locate_answers_live_copies_in_order_by_script_and_by_pipeline(redis_server: RedisServer) -> None:
    now = time.time()
    namespace = f"t{time.monotonic_ns()}"
    scripted = _index(redis_server.url, namespace)
    expected = _fill(scripted, now)
    assert scripted.locate(KEYS, now) == expected
    assert scripted._scripting
    # A user that may not run scripts: the same answer through a pipeline.
    admin = redis.Redis.from_url(redis_server.url)
    admin.acl_setuser("noscripts", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-@scripting"])
    url = f"redis://noscripts:pw@{redis_server.host}:{redis_server.port}/0"
    piped = _index(url, namespace)
    assert piped.locate(KEYS, now) == expected
    assert not piped._scripting
    assert piped.locate(KEYS, now) == expected
    assert piped._link.errors == 0  # refusing the script is not Redis being away
    assert scripted.locate([], now) == []


def test_a_flush_is_one_round_trip_and_a_new_server_gets_everything_again(redis_server: RedisServer,  # noqa: F811
                                                                            monkeypatch) -> None:
    """A finished request waits for the publisher's flush: its updates and the server's
    run id go in one pipeline. Told the server is new (as after a restart), the next
    flush republishes every live entry the node holds, in a second one."""
    from storage.index import IndexPublisher

    index = _index(redis_server.url, "flush")
    a = Location("n1", TierName.RAM)
    now = time.time()
    held = [(KEYS[0], a, now + 60), (KEYS[1], a, now + 60), (KEYS[2], a, now - 1)]  # the last one has expired
    publisher = IndexPublisher(index, time.time, lambda: held, max_pending=100, touch_interval_s=60,
                               heartbeat_s=3600)
    round_trips = []  # the commands of each pipeline sent
    execute = redis.client.Pipeline.execute

    def counted(pipe, *args, **kwargs):
        round_trips.append(len(pipe.command_stack))
        return execute(pipe, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counted)
    try:
        publisher.close()  # its thread stops, and flushes: the first flush, to a Redis new to this node
        assert len(round_trips) == 2 and publisher.resyncs == 1
        assert index.locate(KEYS[:3], time.time()) == [(a,), (a,), ()]
        round_trips.clear()
        publisher.added(KEYS[3], a, now + 60)
        assert publisher.flush()
        assert round_trips == [4]  # zadd, trim, expire, info: one round trip
        assert index.locate(KEYS[3:4], time.time()) == [(a,)]
        index._link.client.delete(index._name(KEYS[0].hex))
        publisher._server = "an earlier run"  # as if Redis had restarted empty
        round_trips.clear()
        assert publisher.flush() and publisher.resyncs == 2 and len(round_trips) == 2
        assert index.locate(KEYS[:1], time.time()) == [(a,)]
    finally:
        publisher.close()


def test_forget_nodes_drops_every_copy_of_those_nodes_and_no_other(redis_server: RedisServer) -> None:  # noqa: F811
    """A dead node's copies leave the index at once, across batches of the scan; the
    other nodes' copies, and the shared Redis tier's, stay."""
    now = time.time()
    index = _index(redis_server.url, f"t{time.monotonic_ns()}")
    dead, alive, shared = (Location("dead", TierName.RAM), Location("dead", TierName.SSD)), \
        Location("alive", TierName.SSD), Location("*", TierName.REDIS)
    updates = [IndexUpdate(key.hex, location, now + 60) for key in KEYS for location in (*dead, alive)]
    assert index.apply(updates + [IndexUpdate(KEYS[1].hex, shared, now + 60)], now)
    assert index.forget_nodes(["dead", "gone"], batch=7) == 2 * len(KEYS)
    located = index.locate(KEYS, now)
    assert located[1] == (shared, alive) and all(copies == (alive,) for i, copies in enumerate(located) if i != 1)
    assert index.forget_nodes(["dead"]) == 0 and index.forget_nodes([]) == 0
