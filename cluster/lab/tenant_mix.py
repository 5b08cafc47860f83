"""A tenant mix in the retention lab (``SimConfig.tenants``): which tenant a request is
of, its owners made the tenant's own, and each tenant's share of a run's result.

Each session belongs to one tenant, drawn by a hash of its id against the tenants'
cumulative shares (a request without a session: its first owner's), so a session's
turns stay with their tenant. Owner ``o`` of tenant ``t`` becomes a 62-bit hash of
(``o``, ``t``) whose low byte is ``t``: tenants never share a chunk, as the server's
salted names never meet, not even a system prompt (the lab does not model prefixes
shared on purpose). Two owners' hashes meet with odds of about 2**-54 per pair.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict

from cluster.lab.workload import Request

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / phi: a multiplicative hash
_MIX = 0xC2B2AE3D27D4EB4F
MAX_TENANTS = 256
TENANT_BITS = 0xFF  # an owner's low byte: its tenant


def _own(owner: int, tenant: int) -> int:
    mixed = ((owner * _GOLDEN + (tenant + 1) * _MIX) & 0xFFFFFFFFFFFFFFFF) ^ (owner >> 29)
    return (mixed & 0x3FFFFFFFFFFFFF00) | tenant


def as_tenant(request: Request, shares: list[float]) -> Request:
    """``request`` as its tenant's (``shares``: the tenants' cumulative shares)."""
    key = request.session if request.session >= 0 else (request.runs[0][0] if request.runs else 0)
    point = ((key * _GOLDEN) & 0xFFFFFFFFFFFFFFFF) / 2.0**64  # in [0, 1)
    tenant = min(bisect.bisect_right(shares, point), len(shares) - 1)
    window, resume = request.window, request.resume
    return request._replace(
        runs=tuple((_own(owner, tenant), first, end) for owner, first, end in request.runs),
        after=tuple((_own(owner, tenant), first, end) for owner, first, end in request.after),
        window=None if window is None else (_own(window[0], tenant), window[1]),
        resume=None if resume is None else (_own(resume[0], tenant), resume[1]))


def tenant_of(request: Request) -> int:
    """The tenant of a request :func:`as_tenant` made its own."""
    owner = request.window[0] if request.window is not None else (request.runs[0][0] if request.runs else 0)
    return owner & TENANT_BITS


def results(config, totals: list, sized_state: dict) -> list[dict]:
    """Each tenant's share of a run (``config``: its ``SimConfig``; ``totals``: each
    tenant's counts; ``sized_state``: the store's, as ``TieredStore.sized_state`` gives
    it): counts, rates, and the bytes it holds in RAM and on SSD at the end."""
    import struct

    owner_of = struct.Struct("<q").unpack_from  # (an object's digest starts with its owner: simulate._KEY)
    held = [{"ram": 0, "ssd": 0} for _ in totals]
    for tier in ("ram", "ssd"):
        for digest, _kind, size, _time in sized_state[tier][1]:
            held[owner_of(digest)[0] & TENANT_BITS][tier] += size * config.shrink
    return [{"name": t.name, "share": t.share, "retention": t.retention, "totals": asdict(counts),
             "rates": counts.rates(), "held_bytes": held[i]}
            for i, (t, counts) in enumerate(zip(config.tenants, totals))]
