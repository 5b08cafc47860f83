"""The store's sizes-only SSD medium (the retention lab's scale mode) makes every decision
the file medium makes: for any sequence of puts, reads, clock steps and GC runs, both
stores answer the same hits and misses and keep the same counters, objects and bytes."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.keys import Fingerprint, Kind, ObjectKey
from storage.policy import RetentionPolicy
from storage.store import StoreConfig, TieredStore
from storage.sized import SizedPayload

pytestmark = pytest.mark.unit

FINGERPRINT = Fingerprint(bytes(range(16)))
POLICY = RetentionPolicy(ram_capacity_bytes=3000, chunk_retention_hours=1.0, window_ttl_minutes=10.0,
                         ssd_capacity_bytes=9000, touch_interval_s=60.0, gc_interval_s=600.0)
KEYS = [ObjectKey(Kind.CHUNK if i % 4 else Kind.WINDOW, bytes([i]) * 32) for i in range(12)]


def _size(i: int) -> int:
    return 200 + 173 * i  # a fixed size per key: the same key always holds the same bytes


operations = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, len(KEYS) - 1)),
    st.tuples(st.just("get"), st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=5)),
    st.tuples(st.just("wait"), st.sampled_from([1.0, 30.0, 400.0, 1900.0])),
    st.tuples(st.just("gc"), st.none()),
), max_size=60)


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _store(root: Path, sizes_only: bool, clock: _Clock) -> TieredStore:
    config = StoreConfig(node_id="n", ssd_dir=root, retention=POLICY, gc_thread=False, write_behind=False,
                         ssd_sizes_only=sizes_only)
    return TieredStore(config, FINGERPRINT, clock=clock)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_sizes_only_and_files_decide_alike(ops):
    with tempfile.TemporaryDirectory() as tmp:
        clock = _Clock()
        files, sizes = _store(Path(tmp) / "files", False, clock), _store(Path(tmp) / "sizes", True, clock)
        try:
            for op, arg in ops:
                if op == "put":
                    files.put(KEYS[arg], bytes([arg]) * _size(arg))
                    sizes.put(KEYS[arg], SizedPayload(_size(arg)))
                elif op == "get":
                    keys = [KEYS[i] for i in arg]
                    got = [None if p is None else len(p) for p in files.get_many(keys)]
                    assert got == [None if p is None else len(p) for p in sizes.get_many(keys)]
                    assert all(p is None or p == _size(i) for p, i in zip(got, arg))
                    assert files.lookup_prefix(keys).chunks == sizes.lookup_prefix(keys).chunks
                elif op == "wait":
                    clock.now += arg
                else:
                    files.gc()
                    sizes.gc()
                a, b = files.stats(), sizes.stats()
                assert (a.tiers, a.objects, a.bytes_stored) == (b.tiers, b.objects, b.bytes_stored)
            assert not any((Path(tmp) / "sizes").rglob("*.chunk"))  # nothing written
        finally:
            files.close()
            sizes.close()
