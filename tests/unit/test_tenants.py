"""Tenants: the API-keys file, each tenant's salt and limits, the router's gate, the
headers a tenant sees, and `v41 serve`'s refusal to serve a public address with no key."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import stat

import pytest

from cluster import UserError
from cluster.cli.serve import API_KEY_ENV, add_arguments, app_arguments, is_loopback
from cluster.serving.admission import TenantGate, shown
from cluster.serving.tenants import Tenants, load_secret, single_tenant
from cluster.serving.validation import ApiError

pytestmark = pytest.mark.unit

KEYS = """
tenants:
  acme:
    keys: ["sk-acme-1", "sk-acme-2"]
    queue_share: 3
    share_prefixes: true
  globex:
    keys: ["sha256:{digest}"]
    max_concurrent: 2
"""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _tenants(tmp_path, text: str | None = None, clock=None) -> Tenants:
    path = tmp_path / "keys.yaml"
    path.write_text(text or KEYS.format(digest=hashlib.sha256(b"sk-globex").hexdigest()))
    return Tenants(path, b"s" * 32, shared_prefix_tokens=128, clock=clock or Clock())


def test_keys_map_to_their_tenants_and_nothing_else_does(tmp_path):
    tenants = _tenants(tmp_path)
    assert tenants.authorize("Bearer sk-acme-1").name == "acme"
    assert tenants.authorize("bearer sk-acme-2").name == "acme"
    assert tenants.authorize("Bearer sk-globex").name == "globex"  # given as its SHA-256
    for header in ("", "Bearer", "Bearer ", "Basic sk-acme-1", "Bearer sk-acme-3", "sk-acme-1",
                   "Bearer sha256:" + hashlib.sha256(b"sk-globex").hexdigest()):
        assert tenants.authorize(header) is None, header
    acme, globex = tenants.tenants["acme"], tenants.tenants["globex"]
    assert len(acme.scope.salt) == 16 and acme.scope.salt != globex.scope.salt
    assert acme.scope.shared_tokens == 128 and globex.scope.shared_tokens == 0  # share_prefixes: false
    again = Tenants(tmp_path / "keys.yaml", b"s" * 32)  # the same secret: the same salts (a restart keeps hits)
    assert again.tenants["acme"].scope.salt == acme.scope.salt
    assert Tenants(tmp_path / "keys.yaml", b"t" * 32).tenants["acme"].scope.salt != acme.scope.salt
    assert not acme.debug_headers and single_tenant().debug_headers and single_tenant().scope.salt == b""


@pytest.mark.parametrize("text, problem", [
    ("tenants: {}", "tenants"),
    ("tenants: {a: {keys: []}}", "tenants.a.keys"),
    ("tenants: {a: {keys: [k], queue_share: 0}}", "queue_share"),
    ("tenants: {a: {keys: [k], max_retention: 48h}}", "max_retention"),
    ("tenants: {a: {keys: [k], max_tokens: 5}}", "max_tokens"),
    ("tenants: {'a b': {keys: [k]}}", "tenants.a b"),
    ("tenants: {a: {keys: ['sha256:xyz']}}", "64 hex digits"),
    ("tenants: {a: {keys: [k]}, b: {keys: [k]}}", "one key is given to tenants 'a' and 'b'"),
    ("[1, 2", "not YAML or JSON"),
])
def test_a_bad_keys_file_is_refused_naming_the_setting_never_a_key(tmp_path, text, problem):
    with pytest.raises(ValueError) as error:
        _tenants(tmp_path, text)
    assert problem in str(error.value) and "keys.yaml" in str(error.value)
    assert "sk-" not in str(error.value)


def test_the_file_is_read_again_when_it_changes_and_a_bad_edit_keeps_the_last(tmp_path, caplog, monkeypatch):
    logger = logging.getLogger("ray.serve")  # (Ray's import stops it from propagating to caplog's root handler)
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, caplog.handler])  # (restored after the test)
    clock = Clock()
    tenants = _tenants(tmp_path, clock=clock)
    path = tmp_path / "keys.yaml"
    path.write_text('{"tenants": {"acme": {"keys": ["sk-new"]}}}')  # JSON is YAML; a revoked key
    os.utime(path, ns=(1, 1))  # (a new mtime even within the filesystem's time granularity)
    assert tenants.authorize("Bearer sk-acme-1").name == "acme"  # checked at most once a second
    clock.now = 1.0
    assert tenants.authorize("Bearer sk-acme-1") is None and tenants.authorize("Bearer sk-new").name == "acme"
    path.write_text("tenants: {acme: {keys: [sk-new], queue_share: -1}}")
    os.utime(path, ns=(2, 2))
    clock.now = 2.0
    assert tenants.authorize("Bearer sk-new").name == "acme"
    assert "stays in force" in caplog.text and "queue_share" in caplog.text


def test_the_cache_secret_is_made_once_private_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = load_secret(None)
    path = tmp_path / "cache" / "v41" / "cache-secret"
    # 32 random bytes as 64 hex digits: read back unchanged (raw bytes ending in, say,
    # b"\r" were stripped by the next reader, which then keyed with another secret)
    assert len(first) == 64 and int(first, 16) >= 0 and path.read_bytes() == first and load_secret(None) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    named = tmp_path / "secret"
    named.write_bytes(b"x" * 20 + b"\n")
    assert load_secret(named) == b"x" * 20
    named.write_bytes(b"short")
    with pytest.raises(ValueError, match="needs at least 16"):
        load_secret(named)


def test_a_tenant_holds_at_most_its_share_of_the_places(tmp_path):
    tenants = _tenants(tmp_path)
    acme, globex = tenants.tenants["acme"], tenants.tenants["globex"]
    gate = TenantGate(capacity=10)
    assert gate.limit(acme, 4) == 8  # 3 of 4 shares of 10, rounded up
    assert gate.limit(globex, 4) == 2  # a share of 3, but max_concurrent 2
    places = [gate.enter(acme, 4, lambda n: n) for _ in range(8)]
    with pytest.raises(ApiError) as refused:
        gate.enter(acme, 4, lambda n: 7)
    assert refused.value.status == 429 and refused.value.code == "tenant_limit"
    assert refused.value.headers == {"retry-after": "7"}
    assert [gate.enter(globex, 4, lambda n: n) for _ in range(2)]  # the other tenant's places are free
    places[0].leave()
    places[0].leave()  # once only
    assert gate.in_flight["acme"] == 7
    gate.enter(acme, 4, lambda n: n)
    alone = [gate.enter(single_tenant(), None, lambda n: n) for _ in range(20)]  # one tenant: never refused
    assert len(alone) == 20 and gate.in_flight[""] == 20


def test_the_debug_headers_are_a_tenants_own_choice():
    headers = {"x-v41-moved-bytes": "5", "X-V41-Lookup-At": "1.0", "server-timing": "plan;dur=1",
               "retry-after": "1", "content-type": "application/json"}
    assert shown(headers, single_tenant()) == headers
    assert shown(headers, single_tenant(debug_headers=False)) == {"retry-after": "1",
                                                                  "content-type": "application/json"}


def _serve_args(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return app_arguments(parser.parse_args(list(argv)))


def test_a_public_address_needs_a_key_or_the_insecure_flag(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    _serve_args("--host", "127.0.0.1")
    with pytest.raises(UserError, match="--insecure-no-auth"):
        _serve_args("--host", "0.0.0.0")
    assert "api_key" not in _serve_args("--host", "0.0.0.0", "--insecure-no-auth")
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants: {a: {keys: [k]}}")
    args = _serve_args("--host", "0.0.0.0", "--api-keys", str(keys))
    assert args["api_keys_file"] == str(keys) and "api_key_file" not in args
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _serve_args("--host", "0.0.0.0")["api_key"] == "from-env"


def test_the_app_may_show_every_tenant_the_debug_headers(tmp_path):
    from types import SimpleNamespace

    from cluster.serving.admission import Access

    path = tmp_path / "keys.yaml"
    path.write_text("tenants: {a: {keys: [k]}}")
    (tmp_path / "secret").write_bytes(b"s" * 32)
    settings = dict(resolved_api_key=lambda: None, api_keys_file=str(path), cache_secret_file=str(tmp_path / "secret"),
                    shared_prefix_tokens=0, places=lambda: 8)
    headers = {"x-v41-moved-bytes": "5", "v41-cache-retention": "72h"}
    quiet = Access(SimpleNamespace(**settings, debug_headers=False), lambda n: 1)
    loud = Access(SimpleNamespace(**settings, debug_headers=True), lambda n: 1)
    tenant = quiet.tenants.tenants["a"]
    assert quiet.shown(headers, tenant) == {"v41-cache-retention": "72h"}
    assert loud.shown(headers, tenant) == headers
    request = SimpleNamespace(headers={"authorization": "Bearer k"})
    assert quiet.authorize(request).name == "a"
    with pytest.raises(ApiError) as refused:
        quiet.authorize(SimpleNamespace(headers={}))
    assert refused.value.status == 401


@pytest.mark.parametrize("client", ["reads it all", "gone before the first byte"])
def test_a_streamed_answer_gives_its_place_back_however_it_ends(client, tmp_path):
    """A place leaks only if nothing gives it back: a stream whose client left before
    its headers went out never starts its body, so the response itself gives it back."""
    import asyncio

    from cluster.serving.admission import PlacedStream

    gate = TenantGate(capacity=4)
    place = gate.enter(single_tenant(), None, lambda n: 1)

    async def chunks():
        yield b"data: 1\n\n"

    async def send(message):
        if client != "reads it all":
            raise OSError("the client is gone")

    async def receive():
        await asyncio.sleep(3600)

    async def serve():
        response = PlacedStream(place, chunks(), media_type="text/event-stream")
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    assert gate.in_flight[""] == 1
    if client == "reads it all":
        asyncio.run(serve())
    else:
        from starlette.requests import ClientDisconnect

        with pytest.raises(ClientDisconnect):  # (what Starlette makes of a send that fails)
            asyncio.run(serve())
    assert gate.in_flight[""] == 0
