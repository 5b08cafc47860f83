"""Who comes in, and how many at once: the caller's tenant, and each tenant's places.

:meth:`Access.authorize` maps a request's API key to its tenant
(:mod:`cluster.serving.tenants`; one tenant and an optional single key without a keys
file) and makes it the request's owner of stored records.

The app holds at most ``capacity`` generation requests at once without refusing any
(:meth:`actors.config.AppConfig.places`: every decoder replica's places and the bounded
queue behind them). A tenant may hold at most its share of them (its ``queue_share``
over all tenants' shares, rounded up) and at most its ``max_concurrent``; a request
beyond that is answered 429 at once and changes nothing, while every other tenant's
requests still find their places free: one tenant's flood fills its own share, not the
queue. With one tenant (no keys file) the gate never refuses: the queue's own bound
answers 429 (``queue_full``) as before.
"""

from __future__ import annotations

import hmac
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from starlette.responses import StreamingResponse

from cluster.serving.tenants import OWNER, Tenant, Tenants, load_secret, single_tenant
from cluster.serving.validation import ApiError


class Place:
    """A request's place at the router, given back once, however the request ends."""

    def __init__(self, gate: "TenantGate", tenant: str) -> None:
        self._gate, self.tenant, self.left = gate, tenant, False

    def leave(self) -> None:
        if not self.left:
            self.left = True
            self._gate.release(self.tenant)


class PlacedStream(StreamingResponse):
    """A streamed answer that gives its request's place back when the response has been
    sent, however that ends (finished, failed, or its client gone before the first byte:
    a body iterator never started would never run a ``finally``)."""

    def __init__(self, place: Place, content: AsyncIterator, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.place = place

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.place.leave()


class TenantGate:
    """Generation requests in flight per tenant (from authorization to the answer's end)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight: Counter[str] = Counter()

    def limit(self, tenant: Tenant, total_shares: int) -> int:
        """How many requests ``tenant`` may hold at once."""
        share = math.ceil(self.capacity * tenant.policy.queue_share / max(total_shares, tenant.policy.queue_share))
        return min(share, tenant.policy.max_concurrent)

    def enter(self, tenant: Tenant, total_shares: int | None, retry_after: Callable[[int], int]) -> Place:
        """A place for one request of ``tenant``, or a 429 when its share is in use
        (``total_shares`` None: one tenant, never refused; ``retry_after(n)``: the
        seconds to suggest with ``n`` requests ahead)."""
        held = self.in_flight[tenant.name]
        limit = None if total_shares is None else self.limit(tenant, total_shares)
        if limit is not None and held >= limit:
            raise ApiError(429, f"this API key's tenant has {held} requests in flight, its limit on this server "
                                f"({limit}); retry when one has finished", kind="rate_limit_error",
                           code="tenant_limit", headers={"retry-after": str(retry_after(held))})
        self.in_flight[tenant.name] += 1
        return Place(self, tenant.name)

    def release(self, tenant: str) -> None:
        self.in_flight[tenant] -= 1
        if not self.in_flight[tenant]:
            del self.in_flight[tenant]


class Access:
    """The router's door: ``config`` (an :class:`actors.config.AppConfig`) names the key,
    or the keys file; ``retry_after(n)``: seconds until ``n`` requests have likely
    finished (the dispatcher's estimate)."""

    def __init__(self, config, retry_after: Callable[[int], int]) -> None:
        self.api_key = config.resolved_api_key()
        self.tenants = None if config.api_keys_file is None else Tenants(
            Path(config.api_keys_file),
            load_secret(None if config.cache_secret_file is None else Path(config.cache_secret_file)),
            config.shared_prefix_tokens)
        self.only_tenant = single_tenant()
        self.debug_headers = config.debug_headers
        self.gate = TenantGate(config.places())
        self.retry_after = retry_after

    def authorize(self, request) -> Tenant:
        """The caller's tenant (a 401 for a missing or unknown key); its name becomes the
        request's :data:`~cluster.serving.tenants.OWNER`."""
        header = request.headers.get("authorization", "")
        if self.tenants is not None:
            tenant = self.tenants.authorize(header)
        elif self.api_key is None or hmac.compare_digest(header.encode(), f"Bearer {self.api_key}".encode()):
            tenant = self.only_tenant
        else:
            tenant = None
        if tenant is None:
            raise ApiError(401, "invalid API key", kind="authentication_error", code="invalid_api_key")
        OWNER.set(tenant.name)
        return tenant

    def shown(self, headers: dict[str, str], tenant: Tenant) -> dict[str, str]:
        """:func:`shown`, with every tenant allowed the debugging headers when the app says so."""
        return headers if self.debug_headers else shown(headers, tenant)

    def enter(self, tenant: Tenant) -> Place:
        """The tenant's place for one generation request (a 429 beyond its share)."""
        total = None if self.tenants is None else sum(t.policy.queue_share for t in self.tenants.tenants.values())
        return self.gate.enter(tenant, total, self.retry_after)


def shown(headers: dict[str, str], tenant: Tenant) -> dict[str, str]:
    """An answer's headers for ``tenant``: without the debugging ones (``x-v41-*``: where
    the cache came from, the bytes moved, when it was looked up and stored;
    ``Server-Timing``) unless it may see them. They tell of the cluster's state, which
    other tenants' traffic shapes."""
    if tenant.debug_headers:
        return headers
    return {name: value for name, value in headers.items()
            if not name.lower().startswith("x-v41-") and name.lower() != "server-timing"}
