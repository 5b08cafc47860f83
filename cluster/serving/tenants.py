"""Who is asking: API keys mapped to tenants, each with its own cache namespace and limits.

An API-keys file (``api_keys_file``; ``v41 serve --api-keys FILE``), YAML or JSON::

    tenants:
      acme:
        keys: ["sk-acme-1", "sha256:3f7a..."]   # a key as is, or the SHA-256 of it in hex
        queue_share: 2          # its weight in the router's places (default 1)
        max_concurrent: 64      # its requests in flight at once, at most (default 64)
        max_retention: 24h      # its cache kept at most so long: in_memory, 24h or 72h (default)
        share_prefixes: true    # its prompts' first shared_prefix_tokens hit every sharing tenant's
        debug_headers: false    # the x-v41-* and Server-Timing headers in its answers

The file is read again when it changes (its size or modification time; checked at most
once a second), so keys are added and revoked without a restart; a file that no longer
parses keeps the last good one in force, and says why in the log.

Each tenant's cached conversations are named under a salt of its own
(:class:`storage.keys.KeyScope`): a keyed hash of its name under the deployment's cache
secret (``cache_secret_file``, else a random one the router makes once, 0600, in the
user's v41 cache folder). A request of one tenant can therefore never hit another
tenant's stored prefix, nor learn from its timing or usage that one exists. Stored
responses and conversations are named under their owner too (:data:`OWNER`), so another
tenant's id reads as unknown.

Without a keys file the server has one tenant, as before: an optional single API key,
no salt, the debug headers on.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cluster.serving.validation import Retention
from storage.keys import CacheRetention, KeyScope
from storage.private import own_secret, read_secret

logger = logging.getLogger("ray.serve")

DEFAULT_TENANT = ""
"""The name of the one tenant of a server without a keys file (its records' keys are those
of a single-tenant server: stored responses survive turning tenants off and on)."""

OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("v41_owner", default=DEFAULT_TENANT)
"""The tenant a request comes from, set by the router when it authorizes the request:
:class:`cluster.serving.records.Records` names stored responses and conversations under it.
(A context variable: it follows the request into its tasks and worker threads.)"""

_SHA256 = "sha256:"


class TenantPolicy(BaseModel):
    """One tenant's entry in the keys file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keys: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    queue_share: Annotated[int, Field(strict=True, ge=1)] = 1
    max_concurrent: Annotated[int, Field(strict=True, ge=1)] = 64
    share_prefixes: bool = False
    debug_headers: bool = False
    max_retention: Retention = "72h"

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if key.startswith(_SHA256):
                digest = key.removeprefix(_SHA256)
                if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
                    raise ValueError("a sha256: key is 64 hex digits")
            elif key != key.strip():
                raise ValueError("a key has no spaces around it")
        return keys


class TenantsFile(BaseModel):
    """The keys file: ``tenants``, by name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenants: dict[Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")], TenantPolicy] \
        = Field(min_length=1)


@dataclass(frozen=True)
class Tenant:
    """An authorized caller: its name, its limits and the scope its cache keys take."""

    name: str
    policy: TenantPolicy
    scope: KeyScope

    @property
    def debug_headers(self) -> bool:
        return self.policy.debug_headers

    def retention(self, asked: CacheRetention | None) -> CacheRetention:
        """How long a request's cache is kept: as it asked (``prompt_cache_retention``;
        None: the deployment's 72 h), at most the tenant's ``max_retention``."""
        return (asked or CacheRetention.DEFAULT).at_most(CacheRetention(self.policy.max_retention))

    def group(self, key: bytes | None) -> bytes | None:
        """A ``prompt_cache_key``'s routing group: the tenant's own (a digest of both)."""
        if key is None:
            return None
        return hashlib.blake2b(key, digest_size=16, key=self.name.encode()[:64], person=b"v41-cache-group").digest()

    def scope_for(self, retention: CacheRetention) -> KeyScope:
        """The names of a request's cache that is kept so."""
        return dataclasses.replace(self.scope, retention=retention)


def parse_tenants(text: str, source: str) -> TenantsFile:
    """A keys file's text (YAML, which JSON is too) as :class:`TenantsFile`; a ValueError
    naming ``source`` and the setting otherwise (never a key's value)."""
    import yaml

    try:
        data = yaml.safe_load(text)
        return TenantsFile.model_validate(data)
    except yaml.YAMLError as error:
        raise ValueError(f"{source}: not YAML or JSON ({error.__class__.__name__})") from None
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}" for e in error.errors())
        raise ValueError(f"{source}: {problems}") from None


def key_digest(key: str) -> bytes:
    """The SHA-256 of a key (what a ``sha256:`` entry holds)."""
    return hashlib.sha256(key.encode()).digest()


def load_secret(path: Path | None) -> bytes:
    """The deployment's cache secret: the bytes of ``path``, else the router's own
    (``<v41 cache folder>/cache-secret``, made once: 32 random bytes, 0600, in a 0700
    folder, never replaced)."""
    if path is not None:
        return read_secret(path)
    from storage.slots import default_secret_file

    return own_secret(default_secret_file())


class Tenants:
    """The keys file, kept current: :meth:`authorize` maps a request's bearer token to its
    tenant. ``shared_prefix_tokens``: the leading tokens of a prompt a tenant with
    ``share_prefixes`` names under the deployment's namespace (a system prompt every
    tenant sends). ``clock``: monotonic seconds (a test's)."""

    RECHECK_S = 1.0

    def __init__(self, path: Path, secret: bytes, shared_prefix_tokens: int = 0, clock=time.monotonic) -> None:
        self.path, self._secret, self._clock = Path(path), secret, clock
        self.shared_prefix_tokens = shared_prefix_tokens
        self._seen: tuple[int, int] | None = None
        self._by_key: dict[bytes, Tenant] = {}
        self.tenants: dict[str, Tenant] = {}
        self._reload(first=True)
        self._checked = clock()

    def authorize(self, header: str) -> Tenant | None:
        """The tenant whose key ``header`` (``Bearer KEY``) carries, None for no known key."""
        self._maybe_reload()
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        return self._by_key.get(key_digest(key.strip()))

    def salt(self, name: str) -> bytes:
        """Tenant ``name``'s salt: a keyed hash of its name under the cache secret."""
        return hmac.new(self._secret, b"v41-tenant-salt\0" + name.encode(), hashlib.blake2b).digest()[:16]

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked >= self.RECHECK_S:
            self._checked = now
            self._reload()

    def _reload(self, first: bool = False) -> None:
        try:
            stat = self.path.stat()
            seen = (stat.st_mtime_ns, stat.st_size)
            if seen == self._seen:
                return
            parsed = parse_tenants(self.path.read_text(), str(self.path))
        except (OSError, ValueError) as error:
            if first:
                raise ValueError(str(error)) from None
            logger.error("the API keys file was not reloaded, the last one stays in force: %s", error)
            return
        self._seen = seen
        tenants = {name: Tenant(name, policy, KeyScope(self.salt(name),
                                                       self.shared_prefix_tokens if policy.share_prefixes else 0))
                   for name, policy in parsed.tenants.items()}
        by_key: dict[bytes, Tenant] = {}
        for tenant in tenants.values():
            for key in tenant.policy.keys:
                digest = bytes.fromhex(key.removeprefix(_SHA256)) if key.startswith(_SHA256) else key_digest(key)
                if by_key.setdefault(digest, tenant) is not tenant:
                    message = f"{self.path}: one key is given to tenants {by_key[digest].name!r} and {tenant.name!r}"
                    if first:
                        raise ValueError(message)
                    logger.error("the API keys file was not reloaded, the last one stays in force: %s", message)
                    return
        self.tenants, self._by_key = tenants, by_key
        if not first:
            logger.info("API keys file reloaded: %d tenants", len(self.tenants))


def single_tenant(debug_headers: bool = True) -> Tenant:
    """The one tenant of a server without a keys file: no salt (today's cache names)."""
    return Tenant(DEFAULT_TENANT, TenantPolicy(keys=["-"], max_concurrent=1 << 30, debug_headers=debug_headers),
                  KeyScope())

