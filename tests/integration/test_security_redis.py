"""Issue #57, parts 3 and 6: the embedded Redis is no door for other local users, and
no secret is ever on a command line; a key the store cannot parse stops no GC.

Real redis-server processes throughout (the one `v41 serve` embeds).
"""

from __future__ import annotations

import argparse
import os
import socket
import stat
import struct
import time
from pathlib import Path

import pytest
import redis
from redis.connection import parse_url

from cluster import UserError
from cluster.cli import main
from cluster.cli.serve import add_arguments, app_arguments
from storage.keys import Fingerprint, chunk_keys
from storage.policy import RetentionPolicy
from storage.redis_server import RedisServer
from storage.store import StoreConfig, TieredStore
from tests.redis_server import redis_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

FP = Fingerprint.of("tiny", {"layers": 4})
KEYS = chunk_keys(FP, range(64 * 4), 64)
REDIS_PASSWORD_ENV = "V41_REDIS_PASSWORD"  # (the documented name, spelled out)


def _raw(server: RedisServer, command: bytes) -> bytes:
    """One RESP command on a fresh socket, no client library and no AUTH: what any local
    process can send."""
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(command)
        return sock.recv(4096)


def test_the_embedded_redis_refuses_a_client_without_the_password(redis_server: RedisServer) -> None:  # noqa: F811
    assert _raw(redis_server, b"*1\r\n$4\r\nPING\r\n").startswith(b"-NOAUTH")
    poison = b"*3\r\n$3\r\nSET\r\n$9\r\nv41:loc:x\r\n$1\r\ny\r\n"  # (a write to the location index)
    assert _raw(redis_server, poison).startswith(b"-NOAUTH")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=redis_server.host, port=redis_server.port).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=redis_server.host, port=redis_server.port, password="guess").ping()
    assert redis.Redis.from_url(redis_server.url).ping()


@pytest.mark.parametrize("command", [("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "GET", "dir"),
                                     ("MODULE", "LOAD", "/tmp/evil.so"), ("DEBUG", "SLEEP", "0"), ("SAVE",),
                                     ("FLUSHALL",), ("REPLICAOF", "NO", "ONE")])
def test_commands_that_write_files_or_load_code_are_gone_even_with_the_password(
        redis_server: RedisServer, command: tuple[str, ...]) -> None:  # noqa: F811
    client = redis.Redis.from_url(redis_server.url)
    with pytest.raises(redis.ResponseError, match="unknown command"):
        client.execute_command(*command)
    with pytest.raises(redis.ResponseError, match="(?i)unknown.*command"):  # nor from a Lua script
        client.eval(f"return redis.call({', '.join(repr(part) for part in command)})", 0)
    assert client.ping()


def test_no_secret_on_any_command_line_and_the_servers_files_are_private(tmp_path: Path) -> None:
    password = f"pw-{os.getpid()}-{time.monotonic_ns()}"
    server = RedisServer(password=password, data_dir=tmp_path / "redis")
    server.start()
    try:
        argv = server._process.args  # what the kernel shows in ps until Redis renames itself
        assert not any(password in str(arg) for arg in argv), argv
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # gone meanwhile, or not ours to read
            assert password.encode() not in cmdline, pid
        assert stat.S_IMODE(server.data_dir.stat().st_mode) == 0o700
        for path in (server.conf_file, server.password_file):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert server.password_file.read_text().strip() == password
        assert redis.Redis(host=server.host, port=server.port, password=password).ping()
    finally:
        server.close()


def _parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return app_arguments(parser.parse_args(list(argv)))


@pytest.mark.parametrize("url", ["redis://:secret@redis.internal:1/0", "redis://user:secret@redis.internal:1/0",
                                 "redis://redis.internal:1/0?password=secret"])
def test_a_redis_url_with_a_password_on_the_command_line_is_refused(url: str, monkeypatch, capsys) -> None:
    monkeypatch.delenv(REDIS_PASSWORD_ENV, raising=False)
    with pytest.raises(UserError, match="--redis-password-file") as refused:
        _parse("--redis-url", url)
    assert "secret" not in str(refused.value)
    assert main(["serve", "--redis-url", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "secret" not in err and REDIS_PASSWORD_ENV in err


def test_the_redis_password_comes_from_a_file_or_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(REDIS_PASSWORD_ENV, raising=False)
    secret = tmp_path / "redis-password"
    secret.write_text("p@ss w:rd/1\n")
    url = _parse("--redis-url", "redis://redis.internal:1/0", "--redis-password-file", str(secret))["redis_url"]
    assert parse_url(url)["password"] == "p@ss w:rd/1" and parse_url(url)["host"] == "redis.internal"
    url = _parse("--redis-url", "redis://ops@redis.internal:1/0", "--redis-password-file", str(secret))["redis_url"]
    assert (parse_url(url)["username"], parse_url(url)["password"]) == ("ops", "p@ss w:rd/1")
    url = _parse("--redis-url", "unix:///run/redis.sock?db=0", "--redis-password-file", str(secret))["redis_url"]
    assert (parse_url(url)["path"], parse_url(url)["password"]) == ("/run/redis.sock", "p@ss w:rd/1")
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "from-env")
    assert parse_url(_parse("--redis-url", "redis://redis.internal:1/0")["redis_url"])["password"] == "from-env"
    assert "redis_url" not in _parse()  # exported, with no external Redis: the embedded one has its own
    with pytest.raises(UserError, match="needs --redis-url"):
        _parse("--redis-password-file", str(secret))
    with pytest.raises(UserError, match="empty"):
        (tmp_path / "empty").write_text("")
        _parse("--redis-url", "redis://redis.internal:1/0", "--redis-password-file", str(tmp_path / "empty"))
    monkeypatch.delenv(REDIS_PASSWORD_ENV)
    config = tmp_path / "args.yaml"  # a file may hold a password: only argv may not
    config.write_text("redis_url: redis://:in-a-file@redis.internal:1/0\n")
    assert _parse("--config", str(config))["redis_url"] == "redis://:in-a-file@redis.internal:1/0"


def test_a_filled_in_password_opens_a_server_whose_password_needs_quoting(tmp_path: Path, monkeypatch) -> None:
    password = 'a "quoted" p@ss w:rd\\ with\nnewline é'
    monkeypatch.setenv(REDIS_PASSWORD_ENV, password)
    with RedisServer(password=password, data_dir=tmp_path / "redis") as server:
        url = _parse("--redis-url", f"redis://{server.host}:{server.port}/0")["redis_url"]
        assert redis.Redis.from_url(url).ping()
        assert redis.Redis.from_url(server.url).ping()


def _store(url: str, clock, gc_interval_s: float = 600.0, secret: bytes | None = None) -> TieredStore:
    config = StoreConfig("a", redis_url=url, redis_stores_bytes=True, redis_retry_s=0.05, index_heartbeat_s=0.05,
                         retention=RetentionPolicy(ram_capacity_bytes=0, gc_interval_s=gc_interval_s))
    return TieredStore(config, FP, clock=clock, secret=secret)


def test_a_chunk_planted_in_redis_without_the_secret_is_a_miss(redis_server: RedisServer) -> None:  # noqa: F811
    """Who can write Redis but lacks the cluster's secret can plant a well formed object
    (the right name, envelope, length, header CRC) under a name every user computes, a
    common system prompt's chunk; the store reads a miss, counts it corrupt and drops
    it, and the object it then stores itself is read back."""
    from storage.codec import Codec

    client = redis.Redis.from_url(redis_server.url)
    secret = b"the cluster's secret: 32 bytes.."
    with _store(redis_server.url, time.time, secret=secret) as store:
        for forger in (Codec(FP), Codec(FP, b"a guessed secret, also 32 bytes.")):
            payload = b"attacker's cache bytes" * 100
            name = f"v41:chunk:{KEYS[3].hex}"
            client.set(name, struct.pack("<d", time.time()) + forger.header(KEYS[3], payload) + payload)
            before = store.stats().tiers["redis"].corrupt
            assert store.get(KEYS[3]) is None
            assert store.stats().tiers["redis"].corrupt == before + 1 and not client.exists(name)
        store.put(KEYS[3], b"the real chunk")
        assert store.flush(10)
        assert store.get(KEYS[3]) == b"the real chunk"


def _plant_malformed(client: redis.Redis) -> list[bytes]:
    """Names under the store's namespace that hold no key, each with a value GC sees as expired."""
    names = [b"v41:chunk:zzz", b"v41:chunk:" + b"g" * 64, b"v41:chunk:" + KEYS[1].hex.upper().encode(),
             b"v41:window:\xff\xfe", b"v41:chunk:" + KEYS[2].hex.encode() + b":extra"]
    for name in names:
        client.set(name, b"x")
    client.hset(b"v41:response:" + b"0" * 63, mapping={"a": "b"})  # wrong type and one digit short
    return [*names, b"v41:response:" + b"0" * 63]


def test_gc_skips_keys_it_cannot_parse_and_its_thread_keeps_running(redis_server: RedisServer) -> None:  # noqa: F811
    now = [1_000_000.0]
    client = redis.Redis.from_url(redis_server.url)
    with _store(redis_server.url, lambda: now[0]) as store:
        store.put(KEYS[1], b"a real object")
        assert store.flush(10)
        planted = _plant_malformed(client)
        now[0] += 100 * 3600  # past the chunk's 72 hours
        store.gc()  # does not raise
        assert not client.exists(f"v41:chunk:{KEYS[1].hex}")  # the real one still goes
        assert all(client.exists(name) for name in planted)  # the others are not ours to judge
        assert store.stats().tiers["redis"].expirations == 1
    with _store(redis_server.url, lambda: now[0], gc_interval_s=0.05) as store:
        deadline = time.monotonic() + 10
        while store.stats().gc_runs < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.stats().gc_runs >= 3 and store._gc_thread.is_alive()


def test_a_location_entry_that_is_not_text_fails_no_lookup(redis_server: RedisServer) -> None:  # noqa: F811
    with _store(redis_server.url, time.time) as store:
        store.put(KEYS[0], b"x")
        assert store.flush(10)
        redis.Redis.from_url(redis_server.url).zadd(f"v41:loc:{KEYS[0].hex}", {b"\xff\xfe|ram": time.time() + 60})
        assert store.lookup_prefix(KEYS[:1]).chunks == 1
