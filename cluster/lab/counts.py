"""What the retention lab's simulator counts: the run's totals, the tiers sampled over
virtual time, and the result a run returns.

Compiled with the simulator (``cluster.lab.native``): the simulator adds to
:class:`Totals` on every request.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Totals:
    """Counts over the whole run (tokens are prompt tokens)."""

    requests: int = 0
    input_tokens: int = 0
    hit_tokens_ram: int = 0
    hit_tokens_ssd: int = 0
    requests_hit_ram: int = 0  # requests whose stored prefix came (partly) from RAM
    requests_hit_ssd: int = 0
    window_candidates: int = 0  # requests that continue a turn whose window state may be stored
    window_hits_ram: int = 0
    window_hits_ssd: int = 0
    replays: int = 0  # stored prefix, no window state: the encoder replays the last window
    prefill_tokens: int = 0
    partial_extent_reads: int = 0
    chunk_bytes_written: int = 0
    window_bytes_written: int = 0

    def rates(self) -> dict[str, float]:
        tokens, requests = max(1, self.input_tokens), max(1, self.requests)
        candidates = max(1, self.window_candidates)
        return {
            "hit_rate_ram": self.hit_tokens_ram / tokens, "hit_rate_ssd": self.hit_tokens_ssd / tokens,
            "hit_rate": (self.hit_tokens_ram + self.hit_tokens_ssd) / tokens,
            "request_hit_rate_ram": self.requests_hit_ram / requests,
            "request_hit_rate_ssd": self.requests_hit_ssd / requests,
            "window_hit_rate": (self.window_hits_ram + self.window_hits_ssd) / candidates,
            "replay_rate": self.replays / requests,
        }


@dataclass
class Sample:
    """The tiers' contents at one virtual time."""

    time_s: float
    objects: dict[str, int]
    bytes: dict[str, int]
    requests: int
    chunk_bytes_written: int
    window_bytes_written: int


@dataclass
class Result:
    """A run: its settings, totals and rates, the store's own counters, the samples, the
    virtual time it covered and the wall time it took."""

    config: dict
    totals: Totals
    rates: dict[str, float]
    store: dict
    samples: list[Sample] = field(default_factory=list)
    virtual_s: float = 0.0
    wall_s: float = 0.0
    tenants: list[dict] = field(default_factory=list)  # each tenant's share (SimConfig.tenants)
