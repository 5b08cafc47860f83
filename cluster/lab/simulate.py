"""The retention lab's simulator: a workload replayed on a virtual clock through the real
tiered store (``storage.store.TieredStore``), so that the real retention policy, RAM LRU,
SSD expiry, capacity eviction and window TTL decide every hit and miss.

Events, in time order: a request arrives (its prompt's stored prefix is looked up and
read: the reads restart retention clocks and promote SSD hits to RAM; its window state is
looked for), its turn ends (service time from a stated prefill and decode rate: the
chunks the conversation completed and its window state are stored), GC runs (every
``gc_interval_s`` of virtual time), and the tiers' contents are sampled.

Objects are extents: the chunks of one owner that are written or read together are one
object of their summed size. Under LRU and TTL, chunks used together share one last-use
time and one place in the LRU order, so an extent decides as its chunks would, with
far fewer objects: a turn's new chunks join the extents it read whole just before them
(one object per conversation and owner, rewritten: the store's own put counters count
those rewrites; ``chunk_bytes_written`` counts new chunks only). Two approximations:
reading part of an extent refreshes all of it (counted: ``partial_extent_reads``), and
an extent is evicted whole.

With ``extents=False`` every chunk is its own object, as the live store keeps them
(``v41 cache-sim validate`` runs so, where capacity eviction must match chunk by chunk).

Tenants (``SimConfig.tenants``, scale mode): each session belongs to one, by a hash of
its id and the tenants' shares; every owner a tenant's requests name is the tenant's own
(as the server salts each tenant's names), and its chunks and window states are of the
kinds its retention asks for (:class:`storage.keys.CacheRetention`), so the store keeps
them as it would: 24 h at most, or in RAM only for the window's minutes. The result
counts each tenant's requests, hits and bytes written, and what it holds at the end.

Modes: ``exact`` stores real payloads (sizes divided by ``shrink``) in files under a
temporary directory; ``scale`` keeps sizes only (``SizedSsdTier``: the same policy
code, no I/O). Both give the same counters on the same input (tested).
"""

from __future__ import annotations

import heapq
import itertools
import math
import struct
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

from cluster.lab import checkpoints, tenant_mix
from cluster.lab.collector import collector_paused
from cluster.lab.counts import Result, Sample, Totals
from cluster.lab.request_table import RequestTable
from cluster.lab.sim_config import SimConfig
from cluster.lab.workload import CHUNK_TOKENS, Request, WindowId
from storage.codec import HEADER_BYTES
from storage.keys import CacheRetention, Fingerprint, Kind, ObjectKey
from storage.policy import TierName
from storage.store import StoreConfig, TieredStore
from storage.sized import SizedPayload

CHECKPOINT_SHARE = 0.02  # of a run's wall time, at most, spent writing checkpoints


_KEY = struct.Struct("<qqq8x")
# Enum members by attribute cost ~60 ns each: the loop's are looked up once.
_CHUNK, _WINDOW, _RAM = Kind.CHUNK, Kind.WINDOW, TierName.RAM
FINGERPRINT = Fingerprint(b"v41-cache-sim\x00\x00\x00")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _chunk_key(owner: int, first: int, kind: Kind = _CHUNK) -> ObjectKey:
    return ObjectKey(kind, _KEY.pack(owner, first, 0))


def _window_key(window: WindowId, kind: Kind = _WINDOW) -> ObjectKey:
    return ObjectKey(kind, _KEY.pack(window[0], window[1], 1))


# The counts a tenant's share of the run is told apart by.
_REQUEST_COUNTS = ("requests", "input_tokens", "hit_tokens_ram", "hit_tokens_ssd", "requests_hit_ram",
                   "requests_hit_ssd", "window_candidates", "window_hits_ram", "window_hits_ssd", "replays",
                   "prefill_tokens")
_WRITE_COUNTS = ("chunk_bytes_written", "window_bytes_written")


def _merged(runs) -> list[tuple[int, int, int]]:
    """Runs with each one that continues the previous (same owner, next chunk) joined to it."""
    out: list[tuple[int, int, int]] = []
    for owner, first, end in runs:
        if out and out[-1][0] == owner and out[-1][2] == first:
            out[-1] = (owner, out[-1][1], end)
        else:
            out.append((owner, first, end))
    return out


class Simulator:
    """One node's store under a workload (see the module docstring)."""

    def __init__(self, config: SimConfig, directory: str | Path | None = None) -> None:
        self.config = config
        self.clock = _Clock()
        self._tmp: tempfile.TemporaryDirectory | None = None
        if directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="v41-cache-sim-")
            directory = self._tmp.name
        root = Path(directory)
        self._store_config = StoreConfig(node_id="sim", ssd_dir=root / "ssd", retention=config.policy(),
                                         gc_thread=False, write_behind=False, ssd_sizes_only=config.mode == "scale")
        self.store = TieredStore(self._store_config, FINGERPRINT, clock=self.clock, on_drop=self._dropped,
                                 drops_from=(TierName.SSD,))
        self.totals = Totals()
        self.samples: list[Sample] = []
        # Extents written, per owner: first chunk index -> (end index, key) (an extent may
        # have left the store since; the store is asked).
        self._extents: dict[int, dict[int, tuple[int, ObjectKey]]] = {}
        self._chunk_size = config.sizes.chunk_bytes
        self._sized: dict[int, SizedPayload] = {}
        self._window_payload = self._payload(config.sizes.window_bytes)
        self.earlier_stores: list = []  # the stats of the stores a restart closed
        # The run loop's state (kept here so that a checkpoint holds it).
        self._pending: list[tuple] = []
        self._next_gc, self._next_sample = config.gc_interval_s, 0.0
        self._order = self._consumed = 0
        self._wall_s = 0.0
        # Tenants: an owner's low byte is its tenant (cluster.lab.tenant_mix); the kinds
        # its keys take, by tenant. Without tenants every owner is tenant 0's.
        if len(config.tenants) > tenant_mix.MAX_TENANTS:
            raise ValueError(f"at most {tenant_mix.MAX_TENANTS} tenants")
        self._tenant_bits = tenant_mix.TENANT_BITS if config.tenants else 0
        kinds = [CacheRetention(t.retention).kinds for t in config.tenants] or [(_CHUNK, _WINDOW)]
        self._chunk_kinds = [chunk for chunk, _ in kinds]
        self._window_kinds = [window for _, window in kinds]
        self._shares = list(itertools.accumulate(t.share for t in config.tenants))
        self.tenant_totals = [Totals() for _ in config.tenants]

    def _dropped(self, key: ObjectKey, location) -> None:
        """An extent that left the SSD (which holds every chunk RAM holds) is gone: forget it.
        (The store tells of SSD drops only: RAM evicts ~1.3 objects per request.)"""
        if key.kind is _CHUNK:
            owner, first, _ = _KEY.unpack(key.digest)
            extents = self._extents.get(owner)
            if extents is not None:
                extents.pop(first, None)
                if not extents:
                    del self._extents[owner]

    def _payload(self, stored: int) -> bytes:
        """A payload whose file on SSD (envelope included) is ``stored`` bytes: what RAM
        holds is the payload alone, as in the store. (Scale mode: one immutable
        :class:`SizedPayload` per size, shared.)"""
        size = max(1, (stored - HEADER_BYTES) // self.config.shrink)
        if self.config.mode != "scale":
            return bytes(size)
        payload = self._sized.get(size)
        if payload is None:
            payload = self._sized[size] = SizedPayload(size)
        return payload

    # -- events ------------------------------------------------------------------------

    def arrive(self, request: Request) -> tuple[int, int, list[tuple[int, int, int]]]:
        """Look up and read the request's stored prefix and window state; returns
        (chunks found, tokens it must prefill, the extents found as (owner, first, end))."""
        keys, spans = self._extent_keys(request.runs)
        read = self.store.read_prefix(keys) if keys else ()
        totals = self.totals
        ram = ssd = 0  # chunks found in each
        extents = []
        for (_, tier), (owner, first, size, used) in zip(read, spans):
            if tier is _RAM:
                ram += used
            else:
                ssd += used
            totals.partial_extent_reads += used < size
            extents.append((owner, first, first + size))
        hit_chunks = ram + ssd
        totals.requests += 1
        totals.input_tokens += request.input_tokens
        totals.hit_tokens_ram += ram * CHUNK_TOKENS
        totals.hit_tokens_ssd += ssd * CHUNK_TOKENS
        totals.requests_hit_ram += ram > 0
        totals.requests_hit_ssd += ssd > 0
        resume_at = hit_chunks * CHUNK_TOKENS
        resume = request.resume
        if resume is not None and hit_chunks >= resume[1] // CHUNK_TOKENS and resume[1] >= resume_at:
            totals.window_candidates += 1
            window = self.store.read_prefix([_window_key(resume, self._window_kinds[resume[0] & self._tenant_bits])])
            if window:
                if window[0][1] is _RAM:
                    totals.window_hits_ram += 1
                else:
                    totals.window_hits_ssd += 1
                resume_at = resume[1]
            else:
                totals.replays += 1
        elif hit_chunks:
            totals.replays += resume_at < request.input_tokens  # resuming after chunks: replay the window
        prefill = request.input_tokens - resume_at
        totals.prefill_tokens += prefill
        return hit_chunks, prefill, extents

    def turn_end(self, request: Request, hit_chunks: int, found: Sequence[tuple[int, int, int]] = ()) -> None:
        """Store the chunks the conversation completed (from the first not found) and the
        window state after the answer. The new chunks of an owner join the extents of that
        owner read whole just before them (all were used now: one last-use time), so a
        conversation stays one object per owner."""
        position = 0  # chunks of the conversation before this run
        for owner, first, end in _merged((*request.runs, *request.after)):
            lo = first + max(0, hit_chunks - position)
            position += end - first
            if lo >= end:
                continue
            if not self.config.extents:
                for index in range(lo, end):
                    self._put_extent(owner, index, index + 1, new=1)
                continue
            start = lo
            for extent_owner, extent_first, extent_end in reversed(found):
                if extent_owner != owner or extent_end != start:
                    break
                start = extent_first
            self._put_extent(owner, start, end, new=end - lo)
        if request.window is not None:
            kind = self._window_kinds[request.window[0] & self._tenant_bits]
            self.store.put(_window_key(request.window, kind), self._window_payload)
            self.totals.window_bytes_written += self.config.sizes.window_bytes

    def _put_extent(self, owner: int, first: int, end: int, new: int) -> None:
        # Extents of this owner overlapping the new one are stale (a prefix before them
        # was gone) or grow into it: the new one replaces them. One that starts where it
        # does has its key: that object is rewritten in place (as a remove and a put would).
        extents = self._extents.get(owner)
        if extents is not None:
            for start in [s for s, (e, _) in extents.items() if s < end and e > first and s != first]:
                self.store.remove(extents.pop(start)[1])  # (the drop callback may forget the owner)
        key = _chunk_key(owner, first, self._chunk_kinds[owner & self._tenant_bits])
        self._extents.setdefault(owner, {})[first] = (end, key)
        self.store.put(key, self._payload((end - first) * self._chunk_size), replace=True)
        self.totals.chunk_bytes_written += new * self._chunk_size

    def _extent_keys(self, runs) -> tuple[list[ObjectKey], list[tuple[int, int, int, int]]]:
        """The stored extents that cover the runs from their start, in order, and per
        extent (owner, first chunk, its chunks, the chunks of it the runs use)."""
        keys: list[ObjectKey] = []
        spans: list[tuple[int, int, int, int]] = []
        for owner, first, end in runs:
            extents = self._extents.get(owner)
            position = first
            while position < end:
                extent = extents.get(position) if extents is not None else None
                if extent is None:
                    return keys, spans
                stop, key = extent
                keys.append(key)
                spans.append((owner, position, stop - position, min(stop, end) - position))
                position = stop
        return keys, spans

    def restart(self) -> None:
        """The node's store restarts: what RAM held is gone, the SSD tier reopens on its
        files (exact mode: scale mode keeps no files to reopen)."""
        if self.config.mode != "exact":
            raise ValueError("a restart needs the exact mode (the SSD tier reopens its files)")
        self.earlier_stores.append(self.store.stats())  # a reopened store counts from zero
        self.store.close()
        self.store = TieredStore(self._store_config, FINGERPRINT, clock=self.clock, on_drop=self._dropped,
                                 drops_from=(TierName.SSD,))

    def sample(self) -> None:
        stats = self.store.stats()
        scale = self.config.shrink
        self.samples.append(Sample(self.clock.now, dict(stats.objects),
                                   {tier: size * scale for tier, size in stats.bytes_stored.items()},
                                   self.totals.requests, self.totals.chunk_bytes_written,
                                   self.totals.window_bytes_written))

    # -- the loop ----------------------------------------------------------------------

    def run(self, requests: Iterable[Request], progress: Callable[[float, int], None] | None = None,
            restarts: Iterable[float] = (), checkpoint: Path | None = None,
            checkpoint_every_s: float = 300.0, table: RequestTable | None = None) -> Result:
        """Replay ``requests``; the store restarts at each time in ``restarts`` (exact
        mode). With ``checkpoint`` (scale mode), the state is saved there every
        ``checkpoint_every_s`` wall seconds (or less often: saves take at most
        ``CHECKPOINT_SHARE`` of the run however big the state), and a run that finds one resumes from it
        (the same requests must come: the ones it had taken are skipped). ``table``
        receives each request's outcome."""
        started = time.perf_counter()
        config = self.config
        limit = math.inf if config.hours is None else config.hours * 3600.0
        times = sorted(restarts)
        if checkpoint is not None and Path(checkpoint).exists():
            self.load(checkpoint)
            requests = itertools.islice(requests, self._consumed, None)
        saved_at = time.perf_counter()
        every_s = checkpoint_every_s
        with collector_paused():
            for request in requests:
                if request.time_s > limit:
                    break
                self._advance(request.time_s, times, progress)
                self.clock.now = max(self.clock.now, request.time_s)
                self._take(request, table)
                if checkpoint is not None and time.perf_counter() - saved_at >= every_s:
                    self._wall_s += time.perf_counter() - started
                    started = time.perf_counter()
                    self.save(checkpoint)
                    saved_at = time.perf_counter()
                    # A big state takes long to write: keep the saves to a share of the run.
                    every_s = max(checkpoint_every_s, (saved_at - started) * (1 - CHECKPOINT_SHARE) / CHECKPOINT_SHARE)
            # The turns still running end; with --hours, the clock runs on to the limit (GC, samples).
            pending = self._pending
            self._advance(limit if config.hours is not None else max((p[0] for p in pending), default=self.clock.now),
                          times, progress)
        self.sample()
        if checkpoint is not None:
            Path(checkpoint).unlink(missing_ok=True)
        return self._result(time.perf_counter() - started)

    def _take(self, request: Request, table: RequestTable | None) -> None:
        """A request arrives: its prefix and window state are looked up (its outcome goes
        to ``table``), and its turn's end is queued."""
        config = self.config
        if self.tenant_totals:
            request = tenant_mix.as_tenant(request, self._shares)
            counted = [getattr(self.totals, name) for name in _REQUEST_COUNTS]
            hit, prefill, found = self.arrive(request)
            self._count_tenant(request, _REQUEST_COUNTS, counted)
        elif table is None:
            hit, prefill, found = self.arrive(request)
        else:
            totals = self.totals
            before = (totals.hit_tokens_ram, totals.hit_tokens_ssd, totals.window_hits_ram + totals.window_hits_ssd,
                      totals.replays)
            hit, prefill, found = self.arrive(request)
            table.add(request, totals.hit_tokens_ram - before[0], totals.hit_tokens_ssd - before[1],
                      totals.window_hits_ram + totals.window_hits_ssd > before[2], totals.replays > before[3],
                      prefill)
        if request.done_s is not None:
            end = max(request.done_s, request.time_s)
        else:
            end = request.time_s + prefill / config.prefill_tokens_per_s + \
                request.output_tokens / config.decode_tokens_per_s
        self._order += 1
        self._consumed += 1
        heapq.heappush(self._pending, (end, self._order, request, hit, found))

    def _count_tenant(self, request: Request, names: Sequence[str], before: list[int]) -> None:
        """Add what the run's totals gained since ``before`` to the request's tenant's."""
        mine = self.tenant_totals[tenant_mix.tenant_of(request)]
        for name, was in zip(names, before):
            setattr(mine, name, getattr(mine, name) + getattr(self.totals, name) - was)

    def _tenant_turn_end(self, request: Request, hit_chunks: int, found: Sequence[tuple[int, int, int]] = ()) -> None:
        """:meth:`turn_end`, its bytes written counted for the request's tenant too."""
        before = [getattr(self.totals, name) for name in _WRITE_COUNTS]
        self.turn_end(request, hit_chunks, found)
        self._count_tenant(request, _WRITE_COUNTS, before)

    def _advance(self, until: float, restarts: list[float], progress: Callable[[float, int], None] | None) -> None:
        """Every event up to ``until``: turn ends, restarts (popped from ``restarts``), GC, samples."""
        config, pending = self.config, self._pending  # turn ends: (time, order, request, chunks found, extents found)
        clock, heappop = self.clock, heapq.heappop
        turn_end = self._tenant_turn_end if self.tenant_totals else self.turn_end
        while True:
            # The common event in a tight loop: turn ends up to the next restart (which
            # goes first at the same time), GC or sample (which go after).
            stop = min(until, self._next_gc, self._next_sample)
            restart = restarts[0] if restarts else math.inf
            while pending and pending[0][0] <= stop and pending[0][0] < restart:
                end, _, request, hit, found = heappop(pending)
                clock.now = max(clock.now, end)
                turn_end(request, hit, found)
            t = min(pending[0][0] if pending else math.inf, self._next_gc, self._next_sample,
                    restarts[0] if restarts else math.inf)
            if t > until:
                return
            clock.now = max(clock.now, t)
            if restarts and restarts[0] == t:
                restarts.pop(0)
                self.restart()
            elif pending and pending[0][0] == t:
                _, _, request, hit, found = heappop(pending)
                turn_end(request, hit, found)
            elif t == self._next_gc:
                self.store.gc()
                self._next_gc += config.gc_interval_s
            else:
                self.sample()
                self._next_sample += config.sample_every_s
                if progress is not None:
                    progress(clock.now, self.totals.requests)

    def _result(self, wall_s: float) -> Result:
        config, stats = self.config, self.store.stats()
        return Result(config={**{k: v for k, v in asdict(config).items() if k != "sizes"},
                              "sizes": config.sizes.as_dict()},
                      totals=self.totals, rates=self.totals.rates(),
                      store={"tiers": {tier: asdict(counters) for tier, counters in stats.tiers.items()},
                             "objects": stats.objects, "bytes_stored": stats.bytes_stored, "gc_runs": stats.gc_runs},
                      samples=self.samples, virtual_s=self.clock.now, wall_s=self._wall_s + wall_s,
                      tenants=self._tenant_results())

    def _tenant_results(self) -> list[dict]:
        if not self.tenant_totals:
            return []
        return tenant_mix.results(self.config, self.tenant_totals, self.store.sized_state())

    # -- checkpoints (scale mode) --------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write the whole state to ``path`` (:func:`checkpoints.save`), atomically. The
        stored objects and extents are streamed into it ``checkpoints.ROWS_PER_WRITE`` at
        a time: a save of tens of millions of them adds megabytes to the process, not
        gigabytes."""
        state = self.store.sized_state()
        tiers = {tier: state.pop(tier) for tier in ("ram", "ssd")}
        meta = {"config": self._config_fingerprint(), "store": state,
                "clock": self.clock.now, "totals": asdict(self.totals), "samples": [asdict(s) for s in self.samples],
                "pending": [(t, order, checkpoints.request_fields(r), hit, found)
                            for t, order, r, hit, found in self._pending],
                "next_gc": self._next_gc, "next_sample": self._next_sample, "order": self._order,
                "consumed": self._consumed, "wall_s": self._wall_s,
                "tenant_totals": [asdict(t) for t in self.tenant_totals]}
        extents = sum(len(spans) for spans in self._extents.values())
        checkpoints.save(path, meta, tiers, (extents, ((owner, first, end) for owner, spans in self._extents.items()
                                                       for first, (end, _) in spans.items())))

    def load(self, path: Path) -> None:
        """Take back the state :meth:`save` wrote (into a fresh simulator of the same config)."""
        with checkpoints.opened(path, self._config_fingerprint()) as (meta, data):
            state = meta["store"]
            state.update(ram=checkpoints.stored_rows(data["ram"]), ssd=checkpoints.stored_rows(data["ssd"]))
            self.store.restore_sized(state)
            self._extents = {}
            for owner, first, end in checkpoints.extent_rows(data["extents"]):
                kind = self._chunk_kinds[owner & self._tenant_bits]
                self._extents.setdefault(owner, {})[first] = (end, _chunk_key(owner, first, kind))
        self.clock.now = meta["clock"]
        self.totals = Totals(**meta["totals"])
        self.tenant_totals = [Totals(**t) for t in meta.get("tenant_totals", [])] or self.tenant_totals
        self.samples = [Sample(**s) for s in meta["samples"]]
        self._pending = [(t, order, checkpoints.request_of(r), hit, [tuple(f) for f in found])
                         for t, order, r, hit, found in meta["pending"]]
        heapq.heapify(self._pending)
        self._next_gc, self._next_sample = meta["next_gc"], meta["next_sample"]
        self._order, self._consumed, self._wall_s = meta["order"], meta["consumed"], meta["wall_s"]

    def _config_fingerprint(self) -> dict:
        """The settings a checkpoint must have been written with, as JSON gives them back."""
        settings = {k: v for k, v in asdict(self.config).items() if k != "sizes"}
        return settings | {"sizes": self.config.sizes.as_dict(), "tenants": [asdict(t) for t in self.config.tenants]}

    def close(self) -> None:
        self.store.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Simulator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def simulate(config: SimConfig, requests: Iterable[Request], progress=None, restarts: Iterable[float] = (),
             checkpoint: Path | None = None, checkpoint_every_s: float = 300.0,
             table: RequestTable | None = None) -> Result:
    with Simulator(config) as simulator:
        return simulator.run(requests, progress, restarts, checkpoint, checkpoint_every_s, table)
