"""`v41 bench store`: the tiered store's GET/PUT throughput next to the raw tiers.

For chunk-sized objects, each tier of the store is timed against the plain operation
it is built on, on the same bytes, the same number of objects, in the same run:

    ram      TieredStore with host RAM only      vs  copying the bytes in memory
    ssd      TieredStore with SSD only (no RAM)  vs  open/read/close (open/write/close) of files
    ssd-mac  the same, GET only, in a folder others can write (0770), where a read checks
             the keyed MAC instead of the checksum (storage/ssd_tier.py)
    redis    TieredStore with Redis bytes only   vs  redis-py pipelined GET/SET, same batch size

Store GETs use ``get_many`` in batches of 64, the way the engine reads a prefix's
chunks, and raw GETs likewise keep each batch of 64 objects alive until the batch is
done (the store must return them all at once; a raw loop that dropped each object at
once would reuse one warm buffer, which at 256 KiB is several times faster than
fresh memory and no reader of a prefix can do). Store and raw repetitions alternate
and the median of each is reported, as MB/s and as the ratio store/raw. Store GETs
include everything the store does (verification, retention bookkeeping, metrics); SSD
and Redis PUTs include the write-behind hand-off and are timed until ``flush``
returns. The embedded redis-server is started and stopped here. The headline ratios (``*_get_ratio``) are the worst over the object sizes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from storage.keys import Fingerprint, ObjectKey, chunk_keys
from storage.policy import RetentionPolicy
from storage.redis_server import RedisServer, RedisServerError
from storage.store import StoreConfig, TieredStore

_FP = Fingerprint.of("bench", {"purpose": "v41 bench store"})
_BATCH = 64  # keys per get_many (how the engine reads a prefix) and per raw Redis pipeline
_BYTES_PER_REP = 4 << 20
_MAX_OBJECTS = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1,16,256", help="object sizes in KiB, comma-separated (default 1,16,256)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of each side (default 5)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="a directory on the SSD to test (default: a temporary directory)")


@dataclass(frozen=True)
class Row:
    """One measurement: the store's and the raw tier's throughput for one tier, size and op."""

    tier: str
    size_kib: int
    op: str
    store_mb_s: float
    raw_mb_s: float

    @property
    def ratio(self) -> float:
        return self.store_mb_s / self.raw_mb_s


def _compare(store_op: Callable[[int], None], raw_op: Callable[[int], None], nbytes: int, reps: int,
             reset: Callable[[int], None] = lambda rep: None) -> tuple[float, float]:
    """Median MB/s of ``store_op`` and ``raw_op``, run alternately; ``reset`` runs untimed after each pair."""
    store_op(-1), raw_op(-1), reset(-1)  # warm-up: caches, code paths, connections
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(reps):
        order = (True, False) if rep % 2 == 0 else (False, True)  # neither side always goes first
        for is_store in order:
            start = time.perf_counter()
            (store_op if is_store else raw_op)(rep)
            times[is_store].append(time.perf_counter() - start)
        reset(rep)
    return nbytes / statistics.median(times[True]) / 1e6, nbytes / statistics.median(times[False]) / 1e6


class _Objects:
    """Payloads and fresh keys for every repetition (PUTs never rewrite an existing key)."""

    def __init__(self, size: int, reps: int) -> None:
        self.count = max(32, min(_MAX_OBJECTS, _BYTES_PER_REP // size))
        self.payloads = [os.urandom(size) for _ in range(self.count)]
        self.nbytes = size * self.count
        self._keys = chunk_keys(_FP, range(16 * self.count * (reps + 2)), 16)

    def keys(self, rep: int) -> list[ObjectKey]:
        start = (rep + 1) * self.count  # rep -1 is the warm-up
        return self._keys[start:start + self.count]


def _store_put(store: TieredStore, objects: _Objects, flush: bool) -> Callable[[int], None]:
    """One repetition's PUTs through the store (until written behind, with ``flush``)."""
    def put(rep: int) -> None:
        for key, value in zip(objects.keys(rep), objects.payloads):
            store.put(key, value)
        if flush:
            store.flush()

    return put


def _ram_rows(objects: _Objects, size_kib: int, reps: int) -> list[Row]:
    config = StoreConfig("bench", retention=RetentionPolicy(ram_capacity_bytes=4 * objects.nbytes * (reps + 2)))
    payloads = objects.payloads
    with TieredStore(config, _FP) as store:
        store_put = _store_put(store, objects, flush=False)

        raw: dict[int, bytearray] = {}

        def raw_put(rep: int) -> None:
            for i, value in enumerate(payloads):
                raw[i] = bytearray(value)

        put = _compare(store_put, raw_put, objects.nbytes, reps)
        keys = objects.keys(0)

        def store_get(rep: int) -> None:
            for start in range(0, len(keys), _BATCH):
                store.get_many(keys[start:start + _BATCH])

        def raw_get(rep: int) -> None:
            for start in range(0, len(payloads), _BATCH):
                [bytearray(value) for value in payloads[start:start + _BATCH]]

        get = _compare(store_get, raw_get, objects.nbytes, reps)
    return [Row("ram", size_kib, "put", *put), Row("ram", size_kib, "get", *get)]


def _ssd_rows(objects: _Objects, size_kib: int, reps: int, root: Path) -> list[Row]:
    raw_dir = root / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    paths = [raw_dir / f"{i:05d}" for i in range(objects.count)]
    payloads = objects.payloads
    with _ssd_store(root / "store", 0o700) as store:
        if store.ssd_verifies_mac:
            print(f"(the folders above {root} are not private: the ssd rows check the MAC too)", file=sys.stderr)
        store_put = _store_put(store, objects, flush=True)

        def raw_put(rep: int) -> None:
            for path, value in zip(paths, payloads):
                with open(path, "wb") as f:
                    f.write(value)

        def reset(rep: int) -> None:  # keep directories the same size for every repetition
            for key in objects.keys(rep):
                store.remove(key)
            for path in paths:
                path.unlink()

        put = _compare(store_put, raw_put, objects.nbytes, reps, reset)
        keys = objects.keys(0)
        store_put(0)
        raw_put(0)

        get = _ssd_get(store, keys, paths, objects, reps)
    with _ssd_store(root / "store-mac", 0o770) as mac_store:
        _store_put(mac_store, objects, flush=True)(0)
        mac_get = _ssd_get(mac_store, keys, paths, objects, reps)
    return [Row("ssd", size_kib, "put", *put), Row("ssd", size_kib, "get", *get),
            Row("ssd-mac", size_kib, "get", *mac_get)]


def _ssd_store(folder: Path, mode: int) -> TieredStore:
    """An SSD-only store in ``folder``, made with ``mode``: 0700 reads check the
    checksum (unless a folder above ``--dir`` is not private: then the MAC too), one
    others can write (0770) the MAC."""
    folder.mkdir(mode=0o700)
    folder.chmod(mode)
    return TieredStore(StoreConfig("bench", ssd_dir=folder, retention=RetentionPolicy(ram_capacity_bytes=0)), _FP)


def _ssd_get(store: TieredStore, keys: list[ObjectKey], paths: list[Path], objects: _Objects,
             reps: int) -> tuple[float, float]:
    """Store and raw GET MB/s of the same objects, already written on both sides."""

    def store_get(rep: int) -> None:
        for start in range(0, len(keys), _BATCH):
            store.get_many(keys[start:start + _BATCH])

    def raw_get(rep: int) -> None:
        for start in range(0, len(paths), _BATCH):
            batch = []
            for path in paths[start:start + _BATCH]:
                with open(path, "rb") as f:
                    batch.append(f.read())

    result = _compare(store_get, raw_get, objects.nbytes, reps)
    assert store.get(keys[0]) == objects.payloads[0]
    return result


def _empty(client: redis.Redis) -> None:
    """Delete every key (the embedded Redis refuses FLUSHALL: storage/redis_server.py)."""
    batch = []
    for name in client.scan_iter(count=1000):
        batch.append(name)
        if len(batch) == 1000:
            client.unlink(*batch)
            batch = []
    if batch:
        client.unlink(*batch)


def _redis_rows(objects: _Objects, size_kib: int, reps: int, url: str) -> list[Row]:
    client = redis.Redis.from_url(url)
    _empty(client)
    raw_keys = [f"raw:{i}" for i in range(objects.count)]
    payloads = objects.payloads
    batches = range(0, objects.count, _BATCH)
    config = StoreConfig("bench", redis_url=url, redis_stores_bytes=True,
                         retention=RetentionPolicy(ram_capacity_bytes=0))
    with TieredStore(config, _FP) as store:
        store_put = _store_put(store, objects, flush=True)

        def raw_put(rep: int) -> None:
            for start in batches:
                pipe = client.pipeline(transaction=False)
                for name, value in zip(raw_keys[start:start + _BATCH], payloads[start:start + _BATCH]):
                    pipe.set(name, value)
                pipe.execute()

        put = _compare(store_put, raw_put, objects.nbytes, reps)
        keys = objects.keys(0)

        def store_get(rep: int) -> None:
            for start in batches:
                store.get_many(keys[start:start + _BATCH])

        def raw_get(rep: int) -> None:
            for start in batches:
                pipe = client.pipeline(transaction=False)
                for name in raw_keys[start:start + _BATCH]:
                    pipe.get(name)
                pipe.execute()

        get = _compare(store_get, raw_get, objects.nbytes, reps)
        assert store.get(keys[0]) == payloads[0]
    client.close()
    return [Row("redis", size_kib, "put", *put), Row("redis", size_kib, "get", *get)]


def run(args: argparse.Namespace) -> int:
    from cluster import UserError

    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        raise UserError(f"--sizes wants comma-separated KiB, got {args.sizes!r}") from None
    if not sizes or min(sizes) <= 0 or args.reps < 1:
        raise UserError("--sizes must be positive and --reps at least 1")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="v41-bench-store-", dir=args.dir) as work:
        try:
            server = RedisServer(data_dir=Path(work))
            server.start()
        except RedisServerError as error:
            raise UserError(str(error)) from None
        try:
            for size_kib in sizes:
                objects = _Objects(size_kib << 10, args.reps)
                rows += _ram_rows(objects, size_kib, args.reps)
                rows += _ssd_rows(objects, size_kib, args.reps, Path(work) / f"ssd{size_kib}")
                rows += _redis_rows(objects, size_kib, args.reps, server.url)
        finally:
            server.close()

    print(f"{'tier':<7} {'size':>8} {'op':<4} {'store MB/s':>11} {'raw MB/s':>10} {'ratio':>6}")
    for row in rows:
        print(f"{row.tier:<7} {f'{row.size_kib} KiB':>8} {row.op:<4} {row.store_mb_s:>11.0f} "
              f"{row.raw_mb_s:>10.0f} {row.ratio:>6.2f}")
    summary: dict[str, object] = {}
    for tier, op in itertools.product(("ram", "ssd", "ssd-mac", "redis"), ("get", "put")):
        if measured := [r.ratio for r in rows if (r.tier, r.op) == (tier, op)]:
            summary[f"{tier.replace('-', '_')}_{op}_ratio"] = round(min(measured), 3)
    if args.json:
        summary["rows"] = [{**asdict(r), "ratio": round(r.ratio, 3)} for r in rows]
        print(json.dumps(summary))
    else:
        print("worst over sizes: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    return 0
