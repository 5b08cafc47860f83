"""Prometheus metrics through Ray (``ray.util.metrics``), scraped from Ray's metrics port.

One small class per process kind, created inside the replica or actor that reports
them (Ray metrics must be built in a Ray worker). Names start with ``v41_``.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

from ray.util import metrics

_LATENCY_BOUNDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


def depth_label(prompt_tokens: int) -> str:
    """A prompt's depth bucket: "<1K", "1K", "2K", "4K", ... (the power of two below it)."""
    if prompt_tokens < 1024:
        return "<1K"
    return f"{1 << (prompt_tokens.bit_length() - 1) >> 10}K"


def tenant_label(tenant: str) -> str:
    """A tenant's metric label: its name, or ``(none)`` for a server without tenants."""
    return tenant or "(none)"


class RouterMetrics:
    """Per request: time to first token, time per output token, tokens, cache hits; the
    requests, tokens, cache hits and queue wait also by tenant (``tenant``: its name in
    the API-keys file, ``(none)`` without one)."""

    def __init__(self) -> None:
        self.ttft = metrics.Histogram("v41_ttft_seconds", "time to first token, by prompt depth",
                                      boundaries=_LATENCY_BOUNDS, tag_keys=("endpoint", "depth"))
        self.tpot = metrics.Histogram("v41_time_per_output_token_seconds", "time per output token after the first, "
                                      "by prompt depth", boundaries=_LATENCY_BOUNDS, tag_keys=("endpoint", "depth"))
        self.requests = metrics.Counter("v41_requests_total", "requests by endpoint, status and tenant",
                                        tag_keys=("endpoint", "status", "tenant"))
        self.prompt_tokens = metrics.Counter("v41_prompt_tokens_total", "prompt tokens, by tenant",
                                             tag_keys=("tenant",))
        self.cached_tokens = metrics.Counter("v41_cached_prompt_tokens_total", "prompt tokens read from the store, "
                                             "by tenant", tag_keys=("tenant",))
        self.output_tokens = metrics.Counter("v41_output_tokens_total", "generated tokens, by tenant",
                                             tag_keys=("tenant",))
        self.waiting = metrics.Gauge("v41_requests_waiting", "requests sent to the pools without a first token yet "
                                     "(queued for a place in a batch, or in their prefill)")
        self.queue_wait = metrics.Histogram("v41_queue_wait_seconds", "time a ready request waited for a place in "
                                            "a decoder batch, by tenant", boundaries=_LATENCY_BOUNDS,
                                            tag_keys=("tenant",))
        self.store_wait = metrics.Histogram("v41_store_wait_seconds", "time a turn waited for the store of the "
                                            "conversation it continues (its last answer had just gone out)",
                                            boundaries=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 1.0, 5.0])
        self.routed = metrics.Counter("v41_router_decoder_choices_total", "decoder replicas the router chose (routing "
                                      "affinity), by why: kept the conversation, on the cache's node, its "
                                      "prompt_cache_key's group, moved for load, or anywhere (nothing cached)",
                                      tag_keys=("choice",))
        self.redis_up = metrics.Gauge("v41_redis_up", "1 when the cluster index (Redis) answers, else 0")
        self.stores_down = metrics.Gauge("v41_stores_down", "node stores not answering")

    def parts(self, redis_up: bool, stores_down: int) -> None:
        """The health of the parts the cache depends on, as /health last saw it."""
        self.redis_up.set(int(redis_up))
        self.stores_down.set(stores_down)

    def record(self, endpoint: str, status: str, prompt: int = 0, cached: int = 0, output: int = 0,
               ttft: float | None = None, total: float | None = None, tenant: str = "") -> None:
        """One request's end (``tenant``: whose; "" without tenants)."""
        tenant = tenant_label(tenant)
        self.requests.inc(tags={"endpoint": endpoint, "status": status, "tenant": tenant})
        if prompt:
            self.prompt_tokens.inc(prompt, tags={"tenant": tenant})
        if cached:
            self.cached_tokens.inc(cached, tags={"tenant": tenant})
        if output:
            self.output_tokens.inc(output, tags={"tenant": tenant})
        if ttft is not None:
            tags = {"endpoint": endpoint, "depth": depth_label(prompt)}
            self.ttft.observe(ttft, tags=tags)
            if total is not None and output > 1:
                self.tpot.observe((total - ttft) / (output - 1), tags=tags)


class DecoderMetrics:
    """The decoder's queue (running requests, batch size per step) and, with DSpark
    speculation, acceptance length, tokens per backbone pass and scheduled verify lengths."""

    def __init__(self) -> None:
        self.running = metrics.Gauge("v41_decoder_running_requests", "requests in the continuous batch")
        self.queued = metrics.Gauge("v41_decoder_queued_requests", "requests in the replica waiting for a place in "
                                    "its batch")
        self.batch = metrics.Histogram("v41_decoder_batch_size", "requests per decode step",
                                       boundaries=[1, 2, 4, 8, 16, 32, 64])
        self.tokens = metrics.Counter("v41_decoder_step_tokens_total", "tokens emitted by decode steps")
        self.acceptance = metrics.Gauge("v41_spec_acceptance_length",
                                        "tokens per request per backbone pass (since the replica started)")
        self.per_pass = metrics.Gauge("v41_spec_tokens_per_pass", "tokens per backbone pass over the whole batch")
        self.verify_length = metrics.Counter("v41_spec_verify_length_total",
                                             "requests scheduled to verify this many guesses", tag_keys=("length",))
        self.resumed = metrics.Counter("v41_decoder_resumed_total", "returning turns sent to the replica that kept "
                                       "their conversation, by where it was found (resident: in its memory; store: "
                                       "evicted or taken, read from the store)", tag_keys=("found",))
        self.resident_bytes = metrics.Gauge("v41_decoder_resident_bytes", "memory of the finished conversations the "
                                            "replica keeps for their next turn")
        self._lengths: dict[int, int] = {}

    def resident(self, found: bool) -> None:
        """A returning turn named a conversation this replica kept: ``found`` in memory."""
        self.resumed.inc(tags={"found": "resident" if found else "store"})

    def step(self, batch: int, events: int, running: int, spec=None) -> None:
        """After a step of ``batch`` requests that emitted ``events`` tokens; ``spec`` is
        the batcher's cumulative :class:`model.runtime.speculative.SpecMetrics` (or None)."""
        self.batch.observe(batch)
        self.running.set(running)
        if events:
            self.tokens.inc(events)
        if spec is None:
            return
        self.acceptance.set(spec.acceptance_length)
        self.per_pass.set(spec.tokens_per_pass)
        for length, count in spec.verify_lengths.items():
            new = count - self._lengths.get(length, 0)
            if new:
                self.verify_length.inc(new, tags={"length": str(length)})
        self._lengths = dict(spec.verify_lengths)


@dataclass
class LoopStats:
    """A decoder replica's engine loop, counted from its start (`v41 bench serve` reads
    two and subtracts): the trips to the engine thread that stepped, the steps, the
    tokens they made, the wall time in them and the engine thread's CPU time in them,
    and the stream items that carried the tokens out."""

    runs: int = 0  # (each trip steps until another job waits for the thread)
    steps: int = 0
    tokens: int = 0
    step_s: float = 0.0
    step_cpu_s: float = 0.0
    items: int = 0

    def stepped(self, tokens: int, wall_s: float, cpu_s: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.step_s += wall_s
        self.step_cpu_s += cpu_s

    def __sub__(self, before: LoopStats) -> LoopStats:
        return LoopStats(*(a - b for a, b in zip(astuple(self), astuple(before))))


class PrefillMetrics:
    """Prefill time and the wait for remote Engram rows."""

    def __init__(self) -> None:
        self.prefill = metrics.Histogram("v41_prefill_seconds", "prefill time per request", boundaries=_LATENCY_BOUNDS)
        self.engram_wait = metrics.Histogram("v41_engram_wait_seconds",
                                             "time the prefill waited for prefetched Engram rows",
                                             boundaries=_LATENCY_BOUNDS)


class StoreMetrics:
    """A node store's counters per tier, exported as gauges of their totals."""

    FIELDS = ("hits", "misses", "bytes_read", "puts", "evictions", "expirations", "corrupt")

    def __init__(self) -> None:
        self.gauges = {name: metrics.Gauge(f"v41_store_{name}", f"store {name} per tier (total)", tag_keys=("tier",))
                       for name in self.FIELDS}
        self.gc_runs = metrics.Gauge("v41_store_gc_runs", "garbage-collector runs (total)")

    def export(self, stats) -> None:
        for tier, counters in stats.tiers.items():
            for name in self.FIELDS:
                self.gauges[name].set(getattr(counters, name), tags={"tier": tier})
        self.gc_runs.set(stats.gc_runs)
