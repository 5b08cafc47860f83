"""The settings of a retention-lab simulation: the policy under test (capacities,
retention, window TTL, object sizes) and how the simulation runs (mode, service rates,
sampling, virtual hours).

Compiled with the simulator (``cluster.lab.native``), which reads it on every request.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.lab.sizes import Sizes
from storage.keys import CacheRetention
from storage.policy import RetentionPolicy


@dataclass(frozen=True)
class TenantShare:
    """A tenant of the simulated deployment: its share of the sessions and how long it
    asks its cache to be kept (``prompt_cache_retention``: ``in_memory``, ``24h``,
    ``72h``). Tenants never share a chunk (their names are salted apart)."""

    name: str
    share: float
    retention: str = "72h"

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"tenant {self.name!r}: a share is in (0, 1], got {self.share}")
        CacheRetention(self.retention)  # (a ValueError naming the value)

    @classmethod
    def parse(cls, text: str) -> tuple[TenantShare, ...]:
        """``NAME=SHARE:RETENTION,...`` (e.g. ``acme=0.5:72h,globex=0.5:in_memory``);
        the shares must add up to 1."""
        tenants = []
        for part in text.split(","):
            name, _, rest = part.strip().partition("=")
            share, _, retention = rest.partition(":")
            try:
                tenants.append(cls(name, float(share), retention or "72h"))
            except ValueError as error:
                raise ValueError(f"--tenants {part.strip()!r}: {error}") from None
        if abs(sum(t.share for t in tenants) - 1) > 1e-6 or len({t.name for t in tenants}) != len(tenants):
            raise ValueError(f"--tenants {text!r}: distinct names whose shares add up to 1")
        return tuple(tenants)


@dataclass(frozen=True)
class SimConfig:
    """The policy under test and how the simulation runs."""

    sizes: Sizes
    ram_bytes: int = 200 << 30
    ssd_bytes: int | None = None  # None: as much as it needs
    chunk_retention_hours: float = 72.0
    window_ttl_minutes: float = 30.0
    gc_interval_s: float = 600.0
    mode: str = "scale"  # or "exact"
    shrink: int = 1  # object sizes (and capacities) divided by this (exact mode keeps files small)
    prefill_tokens_per_s: float = 20_000.0  # service time of a turn: prefill ...
    decode_tokens_per_s: float = 50.0  # ... then the answer (a synthetic profile's rates: the same)
    sample_every_s: float = 3600.0
    hours: float | None = None  # stop after this much virtual time (None: the whole workload)
    extents: bool = True  # False: one object per chunk, as the live store keeps them (slower; validate)
    tenants: tuple[TenantShare, ...] = ()  # none: one tenant, as a server without a keys file

    def __post_init__(self) -> None:
        if self.mode not in ("exact", "scale"):
            raise ValueError("mode must be 'exact' or 'scale'")
        if self.shrink < 1:
            raise ValueError("shrink must be at least 1")
        if self.tenants and self.mode != "scale":
            raise ValueError("tenants are simulated in scale mode")

    def policy(self) -> RetentionPolicy:
        return RetentionPolicy(
            ram_capacity_bytes=self.ram_bytes // self.shrink, chunk_retention_hours=self.chunk_retention_hours,
            window_ttl_minutes=self.window_ttl_minutes, persist_window_states=self.sizes.persist_windows,
            ssd_capacity_bytes=None if self.ssd_bytes is None else self.ssd_bytes // self.shrink,
            gc_interval_s=self.gc_interval_s)
