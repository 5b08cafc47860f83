"""Local tiers of the store: RAM LRU, SSD files, restarts, corruption, disk full."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from storage.codec import HEADER_BYTES
from storage.keys import Fingerprint, Kind, chunk_keys, window_key
from storage.policy import RetentionPolicy, TierName
from storage.store import StoreConfig, TieredStore
from storage.ssd_tier import write_all

pytestmark = pytest.mark.integration

FP = Fingerprint.of("tiny", {"layers": 4})
KEYS = chunk_keys(FP, range(64 * 40), 64)


def payload(i: int, size: int = 3000) -> bytes:
    return bytes([i % 251]) * 7 + os.urandom(size - 7)


def files(root: Path, suffix: str = "") -> list[Path]:
    return sorted(p for p in (root / "objects").rglob("*") if p.is_file() and p.name.endswith(suffix))


def local_store(root: Path | None, **retention: object) -> TieredStore:
    return TieredStore(StoreConfig("n1", ssd_dir=root, retention=RetentionPolicy(**retention)), FP)


def test_ram_is_an_lru_bounded_in_bytes() -> None:
    with local_store(None, ram_capacity_bytes=10_000) as store:
        data = [payload(i) for i in range(4)]
        for key, value in zip(KEYS[:3], data):
            store.put(key, value)
        assert store.get(KEYS[0]) == data[0]  # KEYS[1] is now the least recently used
        store.put(KEYS[3], data[3])
        assert store.get(KEYS[1]) is None
        assert [store.get(k) for k in (KEYS[0], KEYS[2], KEYS[3])] == [data[0], data[2], data[3]]
        stats = store.stats()
        assert stats.tiers["ram"].evictions == 1 and stats.bytes_stored["ram"] <= 10_000
        assert stats.tiers["ram"].hits == 4 and stats.tiers["ram"].misses == 1


def test_a_restarted_store_finds_what_it_wrote(tmp_path: Path) -> None:
    data = {key: payload(i) for i, key in enumerate(KEYS[:20])}
    window = window_key(FP, range(100), 64)
    with local_store(tmp_path, persist_window_states=True) as store:
        for key, value in data.items():
            store.put(key, value)
        store.put(window, b"window state")
    with local_store(tmp_path, persist_window_states=True) as store:
        assert store.stats().objects["ram"] == 0
        assert store.lookup_prefix(KEYS).chunks == 20
        assert all(store.get(key) == value for key, value in data.items())
        assert store.get(window) == b"window state"
        assert store.stats().tiers["ssd"].hits == 21


def test_concurrent_reads_of_a_key_share_one_disk_read(tmp_path: Path) -> None:
    # A decoder's prefetch and the prefill of the same turn read the same prefix at once.
    data = {key: payload(i) for i, key in enumerate(KEYS[:8])}
    with local_store(tmp_path) as store:
        for key, value in data.items():
            store.put(key, value)
    with local_store(tmp_path) as store:  # RAM empty: every key is on the SSD only
        read, entered, release = [], threading.Event(), threading.Event()
        ssd_get_many = store._ssd.get_many

        def slow_disk(keys):  # injected latency: the first reader is still on the disk
            read.extend(keys)
            entered.set()
            release.wait(5)
            return ssd_get_many(keys)

        store._ssd.get_many = slow_disk
        keys = list(data)
        out: dict[str, list] = {}
        first = threading.Thread(target=lambda: out.setdefault("first", store.get_many(keys)))
        second = threading.Thread(target=lambda: out.setdefault("second", store.get_many(keys[2:6] + keys[2:3])))
        first.start()
        assert entered.wait(5)
        second.start()
        second.join(0.3)  # it waits for the first reader's keys rather than reading them again
        release.set()
        first.join(5)
        second.join(5)
        assert out["first"] == [data[k] for k in keys]
        assert out["second"] == [data[k] for k in keys[2:6] + keys[2:3]]
        assert len(read) == len(set(read)) == len(keys)  # each key read from disk once
        stats = store.stats()
        assert stats.tiers["ssd"].hits == 8 and stats.objects["ram"] == 8  # promoted once


def test_read_prefix_reads_what_lookup_then_get_many_would(tmp_path: Path) -> None:
    """The one-pass prefix read: RAM first, then SSD (promoted), stopping at the first
    key held nowhere; the same payloads and tiers as lookup_prefix + get_many."""
    data = {key: payload(i) for i, key in enumerate(KEYS[:12])}
    with local_store(tmp_path) as store:
        for key, value in data.items():
            store.put(key, value)
        store.flush()
    with local_store(tmp_path) as store:  # restarted: RAM empty, everything on SSD
        for key in KEYS[:4]:
            store.get(key)  # promoted back to RAM
        store.remove(KEYS[9])  # a gap: the prefix ends before it
        assert [hit.locations[0].tier.value for hit in store.lookup_prefix(KEYS[:12]).hits] == \
            ["ram"] * 4 + ["ssd"] * 5
        read = store.read_prefix(KEYS[:12])
        assert [payload for payload, _ in read] == [data[key] for key in KEYS[:9]]
        assert [tier.value for _, tier in read] == ["ram"] * 4 + ["ssd"] * 5
        # The SSD hits were promoted: read again, all nine come from RAM.
        assert [tier.value for _, tier in store.read_prefix(KEYS[:12])] == ["ram"] * 9
        assert store.read_prefix(KEYS[20:24]) == [] and store.read_prefix([]) == []
        ram = store.stats().tiers["ram"]
        # RAM counts as get_many would: a miss per key it lacked (the four gets, keys 4-9
        # in the first prefix read, key 9 in the second, key 20), a hit per key it had.
        assert ram.hits == 4 + 9 and ram.misses == 4 + 6 + 1 + 1


def test_files_are_named_by_key_digest_only(tmp_path: Path) -> None:
    with local_store(tmp_path) as store:
        store.put(KEYS[0], b"x")
    [path] = files(tmp_path)
    assert path.relative_to(tmp_path / "objects").as_posix() == \
        f"{KEYS[0].hex[:2]}/{KEYS[0].hex[2:4]}/{KEYS[0].hex}.chunk"


def test_window_states_stay_off_ssd_unless_persisted(tmp_path: Path) -> None:
    window = window_key(FP, range(100), 64)
    with local_store(tmp_path) as store:
        store.put(window, b"state")
        store.flush()
        assert store.get(window) == b"state"
    assert files(tmp_path) == []
    with local_store(tmp_path / "v4", persist_window_states=True) as store:
        store.put(window, b"state")
    assert len(files(tmp_path / "v4", ".window")) == 1


def corrupt_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def corrupt_flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(data)


def corrupt_flip_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[60] ^= 0x01  # inside the payload length field
    path.write_bytes(data)


def corrupt_append(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"junk")


def corrupt_empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [corrupt_truncate, corrupt_flip_payload, corrupt_flip_header,
                                    corrupt_append, corrupt_empty])
def test_damaged_files_read_as_misses_are_removed_and_heal(tmp_path: Path, damage) -> None:
    value = payload(1, 20_000)
    with local_store(tmp_path) as store:
        store.put(KEYS[0], value)
        store.put(KEYS[1], payload(2))
    damage(next(p for p in files(tmp_path) if KEYS[0].hex in p.name))
    with local_store(tmp_path, ram_capacity_bytes=0) as store:
        assert store.get(KEYS[0]) is None
        assert store.get(KEYS[1]) is not None
        assert store.stats().tiers["ssd"].corrupt == 1
        assert not any(KEYS[0].hex in p.name for p in files(tmp_path))
        assert store.lookup_prefix(KEYS[:2]).chunks == 0
        store.put(KEYS[0], value)
        store.flush()
        assert store.get(KEYS[0]) == value


def test_a_file_swapped_for_another_keys_file_is_a_miss(tmp_path: Path) -> None:
    with local_store(tmp_path) as store:
        store.put(KEYS[0], payload(0))
        store.put(KEYS[1], payload(1))
    one, two = (next(p for p in files(tmp_path) if k.hex in p.name) for k in KEYS[:2])
    one.write_bytes(two.read_bytes())
    with local_store(tmp_path, ram_capacity_bytes=0) as store:
        assert store.get(KEYS[0]) is None
        assert store.stats().tiers["ssd"].corrupt == 1


class SmallDisk:
    """An injected write fault: the disk holds ``limit`` bytes of object files."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root = root
        self.limit = limit
        self.refusals = 0

    def __call__(self, fd: int, buffers: Sequence[bytes]) -> None:
        used = sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())
        if used + sum(len(b) for b in buffers) > self.limit:
            self.refusals += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        write_all(fd, buffers)


def test_a_full_disk_evicts_the_oldest_and_never_fails_a_request(tmp_path: Path) -> None:
    disk = SmallDisk(tmp_path, limit=10 * 3100)
    config = StoreConfig("n1", ssd_dir=tmp_path, retention=RetentionPolicy(ram_capacity_bytes=0))
    data = {key: payload(i) for i, key in enumerate(KEYS[:30])}
    with TieredStore(config, FP, ssd_write=disk) as store:
        for key, value in data.items():
            store.put(key, value)
            store.flush()
        stats = store.stats()
        assert disk.refusals > 0 and stats.tiers["ssd"].evictions > 0
        assert stats.tiers["ssd"].write_errors == 0
        assert store.get(KEYS[29]) == data[KEYS[29]]  # the newest survive
        assert store.get(KEYS[0]) is None  # the oldest made room
        assert sum(p.stat().st_size for p in files(tmp_path)) <= disk.limit
        assert not list(tmp_path.rglob("*.tmp"))


def test_an_object_larger_than_the_disk_is_dropped_not_raised(tmp_path: Path) -> None:
    disk = SmallDisk(tmp_path, limit=1000)
    config = StoreConfig("n1", ssd_dir=tmp_path, retention=RetentionPolicy(ram_capacity_bytes=1 << 20))
    with TieredStore(config, FP, ssd_write=disk) as store:
        store.put(KEYS[0], payload(0))
        store.flush()
        assert store.get(KEYS[0]) is not None  # still served from RAM
        assert store.stats().tiers["ssd"].write_errors == 1


def test_ssd_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    with local_store(tmp_path, ram_capacity_bytes=0, ssd_capacity_bytes=5 * (HEADER_BYTES + 3000)) as store:
        for i, key in enumerate(KEYS[:5]):
            store.put(key, payload(i))
            store.flush()
        assert store.get(KEYS[0]) is not None  # KEYS[1] becomes the oldest
        store.put(KEYS[5], payload(5))
        store.flush()
        assert store.get(KEYS[1]) is None and store.get(KEYS[0]) is not None
        assert store.stats().bytes_stored["ssd"] <= 5 * (HEADER_BYTES + 3000)


def test_a_replacing_put_rewrites_the_ssd_copy_where_a_plain_put_keeps_it(tmp_path: Path) -> None:
    # The retention lab grows an extent under one key: ``put(..., replace=True)``.
    old, new = payload(1), payload(2, 6000)
    with local_store(tmp_path, ram_capacity_bytes=0, ssd_capacity_bytes=10_000) as store:
        store.put(KEYS[0], old)
        store.put(KEYS[0], new)  # a plain put: same key, so the same bytes are already there
        store.flush()
        assert store.get(KEYS[0]) == old
        store.put(KEYS[0], new, replace=True)
        store.flush()
        assert store.get(KEYS[0]) == new and len(files(tmp_path)) == 1
        assert store.stats().bytes_stored["ssd"] == HEADER_BYTES + 6000
        # A replacement the disk cannot take: the stale copy goes too (a miss, never the old bytes).
        store.put(KEYS[0], payload(3, 20_000), replace=True)
        store.flush()
        assert store.get(KEYS[0]) is None and files(tmp_path) == []
        stats = store.stats()
        assert stats.bytes_stored["ssd"] == 0 and stats.tiers["ssd"].write_errors == 1


def test_the_drop_listener_hears_the_tiers_it_asks_for(tmp_path: Path) -> None:
    # Two objects where there is room for one: the first is evicted from RAM, and
    # removing the second drops it from RAM and SSD.
    heard: dict[str, list] = {"all": [], "ssd": []}
    for name, tiers in (("all", tuple(TierName)), ("ssd", (TierName.SSD,))):
        config = StoreConfig("n1", ssd_dir=tmp_path / name, retention=RetentionPolicy(ram_capacity_bytes=4000),
                             write_behind=False)
        with TieredStore(config, FP, on_drop=lambda key, where, name=name: heard[name].append((key, where.tier)),
                         drops_from=tiers) as store:
            store.put(KEYS[0], payload(0))
            store.put(KEYS[1], payload(1))
            store.remove(KEYS[1])
            assert store.stats().tiers["ram"].evictions == 1
    assert heard["all"] == [(KEYS[0], TierName.RAM), (KEYS[1], TierName.RAM), (KEYS[1], TierName.SSD)]
    assert heard["ssd"] == [(KEYS[1], TierName.SSD)]


def test_racing_writers_in_one_store_leave_one_whole_value(tmp_path: Path) -> None:
    values = [payload(i, 50_000) for i in range(2)]
    with local_store(tmp_path, ram_capacity_bytes=0) as store:
        barrier = threading.Barrier(2)

        def write(value: bytes) -> None:
            barrier.wait()
            for _ in range(20):
                store.put(KEYS[0], value)

        threads = [threading.Thread(target=write, args=(v,)) for v in values]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store.flush()
        assert store.get(KEYS[0]) in values
    with local_store(tmp_path, ram_capacity_bytes=0) as store:
        assert store.get(KEYS[0]) in values
    assert len(files(tmp_path)) == 1


def test_pending_writes_are_readable_before_they_land(tmp_path: Path) -> None:
    gate = threading.Event()

    def slow_write(fd: int, buffers: Sequence[bytes]) -> None:
        gate.wait(10)
        write_all(fd, buffers)

    config = StoreConfig("n1", ssd_dir=tmp_path, retention=RetentionPolicy(ram_capacity_bytes=0))
    with TieredStore(config, FP, ssd_write=slow_write) as store:
        store.put(KEYS[0], b"abc")
        assert store.get(KEYS[0]) == b"abc"
        assert store.lookup_prefix(KEYS[:1]).chunks == 1
        gate.set()
        assert store.flush(10)
        assert store.get(KEYS[0]) == b"abc"
        assert store.stats().tiers["ssd"].hits == 1


def test_kind_is_part_of_the_name(tmp_path: Path) -> None:
    key = KEYS[0]
    other_kind = type(key)(Kind.WINDOW, key.digest)
    with local_store(tmp_path, ram_capacity_bytes=0, persist_window_states=True) as store:
        store.put(key, b"chunk")
        store.flush()
        assert store.get(other_kind) is None
