"""Redis: the cluster-wide location index, shared object bytes, passwords, and Redis dying."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import redis

from storage.codec import HEADER_BYTES
from storage.index import Location
from storage.keys import Fingerprint, chunk_keys
from storage.policy import RetentionPolicy, TierName
from storage.redis_server import RedisServer, RedisSupervisor
from storage.store import StoreConfig, TieredStore
from tests.redis_server import redis_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

FP = Fingerprint.of("tiny", {"layers": 4})
KEYS = chunk_keys(FP, range(64 * 40), 64)


def node(node_id: str, url: str, root: Path | None, *, ram: int = 1 << 20, redis_bytes: bool = False,
         namespace: str = "v41") -> TieredStore:
    config = StoreConfig(node_id, ssd_dir=root, redis_url=url, redis_stores_bytes=redis_bytes,
                         redis_namespace=namespace, redis_retry_s=0.05, index_heartbeat_s=0.05,
                         redis_timeout_s=0.5, retention=RetentionPolicy(ram_capacity_bytes=ram))
    return TieredStore(config, FP)


def test_the_index_tells_every_node_where_chunks_live(tmp_path: Path, redis_server: RedisServer) -> None:
    with node("a", redis_server.url, tmp_path / "a") as a, node("b", redis_server.url, tmp_path / "b") as b:
        for key in KEYS[:5]:
            a.put(key, b"x" * 100)
        assert a.flush(10)
        match = b.lookup_prefix(KEYS)
        assert match.chunks == 5
        assert match.hits[0].locations == (Location("a", TierName.RAM), Location("a", TierName.SSD))
        assert b.get(KEYS[0]) is None  # b has no copy and Redis holds no bytes
        match = a.lookup_prefix(KEYS)
        assert match.chunks == 5 and match.hits[4].locations[0] == Location("a", TierName.RAM)


def test_evictions_leave_the_index(tmp_path: Path, redis_server: RedisServer) -> None:
    with node("a", redis_server.url, None, ram=250) as a, node("b", redis_server.url, None) as b:
        a.put(KEYS[0], b"x" * 200)
        a.put(KEYS[1], b"y" * 200)  # evicts KEYS[0] from a's RAM
        assert a.flush(10)
        assert b.lookup_prefix(KEYS[:1]).chunks == 0
        assert b.lookup_prefix(KEYS[1:2]).hits[0].locations == (Location("a", TierName.RAM),)


def test_shared_bytes_serve_other_nodes(tmp_path: Path, redis_server: RedisServer) -> None:
    data = [os.urandom(5000) for _ in range(10)]
    with node("a", redis_server.url, None, redis_bytes=True) as a, \
            node("b", redis_server.url, tmp_path / "b", redis_bytes=True) as b:
        for key, value in zip(KEYS, data):
            a.put(key, value)
        assert a.flush(10)
        assert b.get_many(KEYS[:10]) == data
        assert b.stats().tiers["redis"].hits == 10
        assert b.flush(10)  # promoted: now in b's RAM and on b's SSD
        assert b.lookup_prefix(KEYS[:1]).hits[0].locations[:2] == \
            (Location("b", TierName.RAM), Location("b", TierName.SSD))


def test_corrupt_redis_objects_are_misses_and_removed(redis_server: RedisServer) -> None:
    with node("a", redis_server.url, None, ram=0, redis_bytes=True) as a:
        a.put(KEYS[0], b"payload" * 100)
        a.put(KEYS[1], b"payload" * 100)
        assert a.flush(10)
        client = redis.Redis.from_url(redis_server.url)
        # The value is last use (8 bytes) | header | payload.
        client.setrange(f"v41:chunk:{KEYS[0].hex}", 8 + HEADER_BYTES + 2, b"Y")  # one payload byte
        client.set(f"v41:chunk:{KEYS[1].hex}", b"\0" * 8)  # a last use and no object
        assert a.get_many(KEYS[:2]) == [None, None]
        assert a.stats().tiers["redis"].corrupt == 2
        assert not client.exists(f"v41:chunk:{KEYS[0].hex}", f"v41:chunk:{KEYS[1].hex}")


def test_format_1_objects_read_as_misses_and_gc_removes_them(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    name = f"v41:chunk:{KEYS[0].hex}"
    client.hset(name, mapping={"h": b"\0" * 80, "d": b"old bytes", "t": b"1.0"})  # format 1: a hash
    with node("a", redis_server.url, None, ram=0, redis_bytes=True) as a:
        assert a.get(KEYS[0]) is None
        a.gc()
        assert not client.exists(name)
        a.put(KEYS[0], b"new bytes")
        assert a.flush(10)
        assert a.get(KEYS[0]) == b"new bytes"


def test_a_password_in_the_url_is_used(tmp_path: Path) -> None:
    with RedisServer(password="s3cret", data_dir=tmp_path) as server:
        assert ":s3cret@" in server.url
        with node("a", server.url, None, redis_bytes=True, ram=0) as a:
            a.put(KEYS[0], b"secret bytes")
            assert a.flush(10)
            assert a.get(KEYS[0]) == b"secret bytes"
        wrong = server.url.replace("s3cret", "wrong")
        with node("b", wrong, None, redis_bytes=True) as b:  # refused: serves locally, never raises
            b.put(KEYS[1], b"local")
            assert b.get(KEYS[1]) == b"local"
            assert b.get(KEYS[0]) is None
            assert not b.flush(1) and b.stats().redis_errors > 0


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_redis_killed_mid_run_then_restarted(tmp_path: Path, redis_server: RedisServer) -> None:
    data = {key: os.urandom(2000) for key in KEYS[:20]}
    with node("a", redis_server.url, tmp_path / "a", redis_bytes=True) as a:
        for key in KEYS[:10]:
            a.put(key, data[key])
        assert a.flush(10)

        redis_server.kill()
        for key in KEYS[10:20]:
            a.put(key, data[key])  # RAM now, SSD behind; Redis writes dropped, index queued
        assert all(a.get(key) == data[key] for key in KEYS[:20])
        assert a.lookup_prefix(KEYS).chunks == 20  # from its own tiers
        assert a.flush(10) is False
        stats = a.stats()
        assert not stats.redis_up or stats.redis_errors > 0
        assert stats.index_pending > 0

        redis_server.start()  # same port, empty: a new server run
        with node("b", redis_server.url, tmp_path / "b") as b:

            def on_ssd() -> bool:  # (the SSD copies are written behind RAM: their entries may come later)
                found = b.lookup_prefix(KEYS)
                return found.chunks == 20 and all(Location("a", TierName.SSD) in hit.locations for hit in found.hits)

            assert wait_for(on_ssd)  # a caught the index up, every chunk's SSD copy included
        assert a.stats().index_resyncs >= 2 and a.stats().index_pending == 0
        assert all(a.get(key) == data[key] for key in KEYS[:20])
        a.put(KEYS[20], b"after")
        assert a.flush(10)
        assert a.stats().tiers["redis"].puts >= 11


def test_redis_down_from_the_start(tmp_path: Path) -> None:
    server = RedisServer(data_dir=tmp_path / "redis")  # never started yet
    with node("a", server.url, tmp_path / "a", redis_bytes=True) as a:
        a.put(KEYS[0], b"x")
        assert a.get(KEYS[0]) == b"x"
        assert a.lookup_prefix(KEYS).chunks == 1
        server.start()
        try:
            with node("b", server.url, None) as b:
                assert wait_for(lambda: b.lookup_prefix(KEYS[:1]).chunks == 1)
        finally:
            server.close()


@pytest.mark.parametrize("namespace", ["v41", "other"])
def test_namespaces_keep_deployments_apart(redis_server: RedisServer, namespace: str) -> None:
    with node("a", redis_server.url, None, namespace="v41") as a, \
            node("b", redis_server.url, None, namespace=namespace) as b:
        a.put(KEYS[0], b"x")
        assert a.flush(10)
        assert b.lookup_prefix(KEYS[:1]).chunks == (1 if namespace == "v41" else 0)


def test_the_supervisor_restarts_a_killed_redis_and_the_nodes_republish(tmp_path: Path) -> None:
    """`v41 serve`'s embedded Redis: SIGKILLed, it is back on its port, empty, and the
    node's store publishes everything it holds again (a new server run id)."""
    server = RedisServer(data_dir=tmp_path / "redis")
    server.start()
    supervisor = RedisSupervisor(server, interval_s=0.05)
    supervisor.start()
    try:
        with node("a", server.url, tmp_path / "a") as a, node("b", server.url, tmp_path / "b") as b:
            for key in KEYS[:8]:
                a.put(key, b"x" * 100)
            assert a.flush(10) and b.lookup_prefix(KEYS).chunks == 8
            pid = server._process.pid
            os.kill(pid, 9)  # as the OOM killer would: the supervisor sees it exit
            assert wait_for(lambda: supervisor.restarts == 1 and server.running)
            assert server._process.pid != pid
            assert wait_for(lambda: b.lookup_prefix(KEYS).chunks == 8)
    finally:
        supervisor.stop()
        server.close()
    assert not server.running


def test_a_free_port_is_one_no_outgoing_connection_can_take() -> None:
    """Servers started on a drawn port (Redis, the router) must find it still free
    after a cluster has opened its connections: drawn below the ephemeral range."""
    import socket

    from storage.redis_server import _ephemeral_low, free_port

    low = _ephemeral_low()
    if low < 20000 + 1024:
        pytest.skip(f"this kernel's ephemeral ports start at {low}: no room below them, the OS picks")
    ports = {free_port() for _ in range(8)}
    assert len(ports) > 1
    for port in ports:
        assert 20000 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", port))
            server.listen()
