"""Retention under an injected clock: 72 h for chunks in every tier, minutes for window states,
stored responses for their own hours (on SSD, across a restart)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from storage.index import RedisIndex
from storage.keys import (CacheRetention, Fingerprint, KeyScope, Kind, chunk_keys, conversation_key,
                          response_key, window_key)
from storage.policy import RetentionPolicy
from storage.redis_link import RedisLink
from storage.redis_server import RedisServer
from storage.store import StoreConfig, TieredStore
from tests.redis_server import redis_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

FP = Fingerprint.of("tiny", {"layers": 4})
KEYS = chunk_keys(FP, range(64 * 4), 64)
HOUR = 3600.0


class Clock:
    """The injected clock: seconds, moved by the test."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


# Which tiers a store has: each case must serve a 71 h old chunk and lose a 73 h old one.
TIER_SETS = {
    "ram": dict(ram=True, ssd=False, redis_bytes=False),
    "ssd": dict(ram=False, ssd=True, redis_bytes=False),
    "redis": dict(ram=False, ssd=False, redis_bytes=True),
    "all": dict(ram=True, ssd=True, redis_bytes=True),
}


def make_store(tmp_path: Path, url: str, clock: Clock, *, ram: bool, ssd: bool, redis_bytes: bool,
               **retention: object) -> TieredStore:
    config = StoreConfig(
        "n1", ssd_dir=tmp_path / "ssd" if ssd else None, redis_url=url, redis_stores_bytes=redis_bytes,
        redis_namespace=f"t{time.monotonic_ns()}",
        retention=RetentionPolicy(ram_capacity_bytes=(1 << 20) if ram else 0, **retention))
    return TieredStore(config, FP, clock=clock)


def assert_gone_everywhere(store: TieredStore, key, tmp_path: Path, url: str, clock: Clock) -> None:
    assert store.get(key) is None
    assert store.lookup_prefix([key]).chunks == 0
    assert not [p for p in tmp_path.rglob("*") if key.hex in p.name]
    client = redis.Redis.from_url(url)
    ns = store.config.redis_namespace
    assert not client.exists(f"{ns}:{key.kind.name.lower()}:{key.hex}")
    link = RedisLink(url, namespace=ns, timeout_s=1, retry_s=0)
    assert RedisIndex(link, 1).locate([key], clock()) == [()]
    assert client.zcard(f"{ns}:loc:{key.hex}") == 0  # not just filtered: deleted


@pytest.mark.parametrize("tiers", TIER_SETS, ids=list(TIER_SETS))
def test_a_chunk_lives_72_hours_after_its_last_use(tmp_path: Path, redis_server: RedisServer, tiers: str) -> None:
    clock = Clock()
    with make_store(tmp_path, redis_server.url, clock, **TIER_SETS[tiers]) as store:
        used, unused = KEYS[0], KEYS[1]
        store.put(used, b"used")
        store.put(unused, b"unused")
        assert store.flush(10)
        clock.now += 71 * HOUR
        assert store.get(used) == b"used"  # used 71 h ago: served (and used again now)
        clock.now += 2 * HOUR
        store.gc()
        assert store.flush(10)
        assert_gone_everywhere(store, unused, tmp_path, redis_server.url, clock)  # used 73 h ago
        assert store.get(used) == b"used"  # last used 2 h ago
        stats = store.stats()
        assert sum(t.expirations for t in stats.tiers.values()) >= 1 and stats.gc_runs == 1


def test_a_chunk_73_hours_old_is_a_miss_even_before_gc(tmp_path: Path, redis_server: RedisServer) -> None:
    clock = Clock()
    with make_store(tmp_path, redis_server.url, clock, **TIER_SETS["all"]) as store:
        store.put(KEYS[0], b"old")
        store.flush(10)
        clock.now += 73 * HOUR
        assert store.get(KEYS[0]) is None
        assert store.lookup_prefix(KEYS[:1]).chunks == 0


def test_expired_files_are_deleted_when_a_store_reopens(tmp_path: Path, redis_server: RedisServer) -> None:
    clock = Clock()
    with make_store(tmp_path, redis_server.url, clock, ram=False, ssd=True, redis_bytes=False) as store:
        store.put(KEYS[0], b"a")
    clock.now += 73 * HOUR
    with make_store(tmp_path, redis_server.url, clock, ram=False, ssd=True, redis_bytes=False) as store:
        assert store.stats().tiers["ssd"].expirations == 1
        assert not list((tmp_path / "ssd").rglob("*.chunk"))


def test_a_window_state_is_gone_after_its_minutes(tmp_path: Path, redis_server: RedisServer) -> None:
    clock = Clock()
    window = window_key(FP, range(100), 64)
    with make_store(tmp_path, redis_server.url, clock, ram=True, ssd=True, redis_bytes=True,
                    window_ttl_minutes=30) as store:
        store.put(window, b"state")
        assert store.flush(10)
        clock.now += 29 * 60
        assert store.get(window) == b"state"
        clock.now += 29 * 60
        assert store.get(window) == b"state"  # 29 minutes after its last use
        clock.now += 31 * 60
        store.gc()
        assert store.flush(10)
        assert_gone_everywhere(store, window, tmp_path, redis_server.url, clock)
        assert store.stats().tiers["ram"].expirations == 1


def test_persisted_window_states_outlive_ram_v4_style(tmp_path: Path, redis_server: RedisServer) -> None:
    clock = Clock()
    window = window_key(FP, range(100), 64)
    with make_store(tmp_path, redis_server.url, clock, ram=True, ssd=True, redis_bytes=False,
                    window_ttl_minutes=30, persist_window_states=True) as store:
        store.put(window, b"state")
        store.flush(10)
        clock.now += 10 * HOUR
        assert store.get(window) == b"state"
        assert store.stats().tiers["ssd"].hits == 1


@pytest.mark.parametrize("key, suffix", [(response_key("resp_abc"), "response"),
                                         (conversation_key("conv_abc"), "conversation")])
def test_a_stored_response_or_conversation_outlives_ram_and_a_restart_for_its_hours(
        tmp_path: Path, redis_server: RedisServer, key, suffix) -> None:
    """A response (``POST /v1/responses`` with ``store``) or a conversation
    (``POST /v1/conversations``) leaves RAM after the window's minutes but stays on SSD,
    where a reopened store finds it, until its own retention (here 5 h, shorter than the
    chunks' 72) runs out after its last use."""
    clock = Clock()
    assert key.kind.name == suffix.upper()
    assert len({response_key("resp_abc"), response_key("resp_abd"), conversation_key("resp_abc")}) == 3
    settings = {"ram": True, "ssd": True, "redis_bytes": False, "window_ttl_minutes": 30,
                "response_retention_hours": 5}
    with make_store(tmp_path, redis_server.url, clock, **settings) as store:
        store.put(key, b'{"record": 1}')
        assert store.flush(10)
        clock.now += HOUR
        store.gc()
        assert store.stats().tiers["ram"].expirations == 1
        assert store.get(key) == b'{"record": 1}' and store.stats().tiers["ssd"].hits == 1
    assert list((tmp_path / "ssd").rglob(f"*.{suffix}"))
    clock.now += 4.5 * HOUR  # 4.5 h after its last use (the read above)
    with make_store(tmp_path, redis_server.url, clock, **settings) as store:
        assert store.get(key) == b'{"record": 1}'
        clock.now += 5.5 * HOUR
        store.gc()
        assert store.flush(10)
        assert_gone_everywhere(store, key, tmp_path, redis_server.url, clock)


def test_a_conversation_is_its_newest_version_in_every_tier(tmp_path: Path, redis_server: RedisServer) -> None:
    """A conversation changes under its key: the SSD copy is rewritten (a chunk's key
    always stands for the same bytes, so the SSD keeps the copy it has), and the newest
    version is what RAM, SSD and a reopened store give."""
    clock, key = Clock(), conversation_key("conv_abc")
    settings = {"ram": True, "ssd": True, "redis_bytes": False, "window_ttl_minutes": 30}
    with make_store(tmp_path, redis_server.url, clock, **settings) as store:
        for version in (b'{"version": 1}', b'{"version": 2, "items": []}'):
            store.put(key, version)
            assert store.flush(10) and store.get(key) == version
        clock.now += HOUR
        store.gc()  # out of RAM: read from SSD
        assert store.get(key) == b'{"version": 2, "items": []}' and store.stats().tiers["ssd"].hits == 1
    with make_store(tmp_path, redis_server.url, clock, **settings) as store:
        assert store.get(key) == b'{"version": 2, "items": []}'


def test_retention_numbers_are_config(tmp_path: Path, redis_server: RedisServer) -> None:
    clock = Clock()
    with make_store(tmp_path, redis_server.url, clock, ram=True, ssd=True, redis_bytes=False,
                    chunk_retention_hours=1) as store:
        store.put(KEYS[0], b"a")
        store.flush(10)
        clock.now += 1.5 * HOUR
        assert store.get(KEYS[0]) is None


@pytest.mark.parametrize("tiers", ["ram", "ssd", "all"])
def test_a_chunk_asked_for_24_hours_is_gone_after_24_and_kept_at_23(tmp_path: Path, redis_server: RedisServer,
                                                                    tiers: str) -> None:
    """``prompt_cache_retention: 24h``: its chunks are of their own kind, kept a day
    after their last use in every tier, across a restart (the file's name says its
    retention), while a chunk kept the deployment's way is still there."""
    day = KeyScope(retention=CacheRetention.DAY)
    short, other = chunk_keys(FP, range(64 * 2), 64, scope=day)
    assert short.kind is Kind.CHUNK_24H and short.digest == KEYS[0].digest  # the same name, another kind
    clock = Clock()
    tier_set = {**TIER_SETS[tiers]}
    with make_store(tmp_path, redis_server.url, clock, **tier_set) as store:
        store.put(short, b"a day")
        store.put(other, b"a day, used")
        store.put(KEYS[2], b"the deployment's")
        assert store.flush(10)
        if tier_set["ssd"]:
            assert sorted(p.suffix for p in (tmp_path / "ssd").rglob("*.chunk*")) == [".chunk", ".chunk-24h",
                                                                                    ".chunk-24h"]
        client, name = redis.Redis.from_url(redis_server.url), f"{store.config.redis_namespace}:chunk_24h:{short.hex}"
        assert client.exists(name) == tier_set["redis_bytes"]
        clock.now += 23 * HOUR
        assert store.get(other) == b"a day, used"  # 23 h: kept (and used again)
        config = store.config
    with TieredStore(config, FP, clock=clock) as store:  # a restart: the SSD's scan reads the names
        if tier_set["ssd"] and not tier_set["ram"]:
            assert store.get(other) == b"a day, used"
        clock.now += 1.5 * HOUR  # short: 24.5 h unused
        assert store.get(short) is None
        store.gc()
        assert store.flush(10)
        assert not [p for p in tmp_path.rglob("*") if short.hex in p.name] and not client.exists(name)
        assert store.lookup_prefix([short]).chunks == 0
        if tier_set["ssd"]:
            assert store.get(KEYS[2]) == b"the deployment's"  # 24.5 h: kept (72 h)


def test_a_conversation_asked_in_memory_never_leaves_ram(tmp_path: Path, redis_server: RedisServer) -> None:
    """``prompt_cache_retention: in_memory``: its chunks and window state go to no SSD
    file and no Redis bytes, and are gone from RAM when the window's minutes end."""
    scope = KeyScope(retention=CacheRetention.IN_MEMORY)
    chunk = chunk_keys(FP, range(64), 64, scope=scope)[0]
    window = window_key(FP, list(range(70)), 64, scope=scope)
    assert (chunk.kind, window.kind) == (Kind.CHUNK_IN_MEMORY, Kind.WINDOW_IN_MEMORY)
    clock = Clock()
    with make_store(tmp_path, redis_server.url, clock, ram=True, ssd=True, redis_bytes=True,
                    persist_window_states=True, window_ttl_minutes=30) as store:
        store.put(chunk, b"chunk")
        store.put(window, b"window")
        assert store.flush(10)
        assert not [p for p in tmp_path.rglob("*") if p.is_file()]
        client = redis.Redis.from_url(redis_server.url)
        assert not [name for name in client.scan_iter(f"{store.config.redis_namespace}:*")
                    if b":loc:" not in name]  # index entries only: no bytes
        clock.now += 29 * 60
        assert store.get_many([chunk, window]) == [b"chunk", b"window"]
        clock.now += 31 * 60
        store.gc()
        assert store.get_many([chunk, window]) == [None, None]
        assert store.lookup_prefix([chunk]).chunks == 0
