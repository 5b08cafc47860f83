"""The SSD cache owns only what it made (issue #57, parts 2 and 4): `--cache-dir D`
never adopts, writes into or deletes a folder of D it did not make and mark; what it
makes is private (folders 0700, files 0600, whatever the umask); a slots folder of
another user is refused; the default lives in the user's cache folder, not /tmp.

Real files under ``tmp_path``; the store is opened as the store actor opens it
(``StoreSettings.open``), with the ``ssd_dir`` that `v41 serve`'s flags give."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.store import StoreSettings
from cluster.cli.serve import API_KEY_ENV, add_arguments, app_arguments
from actors.config import AppConfig
from storage.keys import Fingerprint, ObjectKey, chunk_keys
from storage.policy import RetentionPolicy
from storage.private import why_not_private
from storage.slots import SlotError, claim
from storage.store import StoreConfig, TieredStore

pytestmark = pytest.mark.integration

FP = Fingerprint.of("tiny", {"layers": 4})
KEYS = chunk_keys(FP, range(64 * 8), 64)
FIVE_DAYS_AGO = time.time() - 5 * 86400
RETENTION_S = 72 * 3600


def serve_ssd_dir(*argv: str) -> str:
    """The ``ssd_dir`` `v41 serve` gives the store for these flags."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return app_arguments(parser.parse_args(list(argv)))["ssd_dir"]


def user_folder(path: Path) -> dict[str, bytes]:
    """A folder of someone's files, five days old; returns its contents to compare with."""
    (path / "sub").mkdir(parents=True)
    contents = {"notes.txt": b"mine\n", "sub/picture.jpg": b"\xff\xd8 jpeg"}
    for name, data in contents.items():
        (path / name).write_bytes(data)
    for item in (path / "sub" / "picture.jpg", path / "notes.txt", path / "sub", path):
        os.utime(item, (FIVE_DAYS_AGO, FIVE_DAYS_AGO))
    return contents


def listing(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def write_traffic(store: TieredStore) -> None:
    for i, key in enumerate(KEYS):
        store.put(key, bytes([i]) * 2000)
    assert store.flush(10)


def modes(root: Path) -> tuple[set[int], set[int]]:
    """The permission bits of every folder (``root`` included) and every file under ``root``."""
    folders, files = {stat.S_IMODE(os.stat(root).st_mode)}, set()
    for path in root.rglob("*"):
        (folders if path.is_dir() else files).add(stat.S_IMODE(os.lstat(path).st_mode))
    return folders, files


@pytest.fixture(autouse=True)
def _no_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def test_unrelated_folders_in_the_cache_dir_are_neither_adopted_nor_deleted(tmp_path: Path) -> None:
    """The issue's reproduction: `--cache-dir D` with Documents/ and photos/ in D, five
    days old (past the 72 h retention)."""
    cache = tmp_path / "home"
    before = {name: user_folder(cache / name) for name in ("Documents", "photos")}
    slot = claim(serve_ssd_dir("--cache-dir", str(cache)), collect_after_s=RETENTION_S)
    try:
        for name, contents in before.items():
            assert listing(cache / name) == contents, f"{name}/ was changed"
        assert slot.path.parent == cache.resolve() / "v41-slots"
    finally:
        slot.release()


def test_an_unmarked_folder_among_the_slots_is_neither_adopted_nor_deleted(tmp_path: Path) -> None:
    """Names fitting the slot pattern do not make a slot; only the store's own marker does
    (a marker that is not the store's JSON reads as none)."""
    slots = tmp_path / "slots"
    forged = {"node-0": None, "node-1": b"not json", "node-2": json.dumps({"kind": "other"}).encode()}
    before = {}
    for name, marker in forged.items():
        if marker is not None:
            (slots / name).mkdir(parents=True)
            (slots / name / "v41-slot.json").write_bytes(marker)
        before[name] = {**user_folder(slots / name), **({"v41-slot.json": marker} if marker else {})}
    slot = claim(str(slots / "{node}"), collect_after_s=RETENTION_S)
    try:
        assert slot.path.name not in forged
        for name, contents in before.items():
            assert listing(slots / name) == contents, f"{name}/ was changed"
        with pytest.raises(SlotError, match="not a v41 cache slot"):
            claim(str(slots / "{node}"), "node-0")
        assert listing(slots / "node-0") == before["node-0"]
    finally:
        slot.release()


def test_cache_folders_are_0700_and_files_0600_whatever_the_umask(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with umask(0):
        slot = claim(str(cache / "{node}"))
        try:
            with TieredStore(StoreConfig("n1", ssd_dir=slot.path, retention=RetentionPolicy(ram_capacity_bytes=0)),
                             FP) as store:
                write_traffic(store)
        finally:
            slot.release()
    folders, files = modes(cache)
    assert len(list(cache.rglob("*.chunk"))) == len(KEYS)
    assert folders == {0o700} and files == {0o600}


def test_a_slots_folder_of_another_user_or_writable_by_others_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(SlotError, match="writable by other users"):
        claim(str(shared / "{node}"))
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(SlotError, match=r"theirs.*owned by uid 12345"):
        claim(str(theirs / "{node}"))
    assert list(theirs.iterdir()) == []


def test_the_default_cache_is_the_users_own_not_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    expected = str(tmp_path / "xdg" / "v41" / "v41-slots" / "{node}")
    assert AppConfig().ssd_dir == expected
    assert serve_ssd_dir() == expected
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "someone"))
    assert AppConfig().ssd_dir == str(tmp_path / "someone" / ".cache" / "v41" / "v41-slots" / "{node}")


def test_a_fixed_ssd_dir_holding_other_files_is_refused(tmp_path: Path) -> None:
    """An ``ssd_dir`` without {node} is used as given only if the store made it, marked
    it, or found it empty."""
    contents = user_folder(tmp_path / "Documents")
    with pytest.raises(SlotError, match="not a v41 cache"):
        claim(str(tmp_path / "Documents"))
    assert listing(tmp_path / "Documents") == contents
    (tmp_path / "empty").mkdir()
    assert claim(str(tmp_path / "empty")).path == tmp_path / "empty"
    assert claim(str(tmp_path / "new" / "cache")).path == tmp_path / "new" / "cache"


def test_serve_cache_dir_through_traffic_and_a_restart(tmp_path: Path) -> None:
    """Acceptance: `v41 serve --cache-dir D`'s store (opened as the store actor opens it)
    with unrelated folders in D: they are untouched after a start, traffic and a
    restart, the restarted store finds its objects, and no other user can read them."""
    cache = tmp_path / "data"
    before = {name: user_folder(cache / name) for name in ("Documents", "photos", "node-0")}
    settings = StoreSettings(ssd_dir=serve_ssd_dir("--cache-dir", str(cache)),
                             retention=RetentionPolicy(ram_capacity_bytes=0))
    for restart in (False, True):
        store, slot = settings.open("n1", FP)
        try:
            if restart:
                assert all(store.get(key) == bytes([i]) * 2000 for i, key in enumerate(KEYS))
            else:
                write_traffic(store)
        finally:
            store.close()
            slot.release()
    assert {name: listing(cache / name) for name in before} == before
    assert sorted(p.name for p in cache.iterdir()) == ["Documents", "node-0", "photos", "v41-slots"]
    folders, files = modes(cache / "v41-slots")
    assert folders == {0o700} and files == {0o600}


def test_a_private_folder_tree_is_told_from_one_others_can_change(tmp_path: Path) -> None:
    """``why_not_private``: ours and 0700, and no folder above it writable by others
    unless sticky (as /tmp); links are followed to the real folder."""
    base = tmp_path / "base"
    base.mkdir(mode=0o755)
    (base / "mine").mkdir(mode=0o700)
    assert why_not_private(base / "mine") is None
    (base / "open").mkdir(mode=0o700)
    (base / "open").chmod(0o750)
    assert why_not_private(base / "open") == f"{base / 'open'} has mode 0750, not 0700"
    (base / "link").symlink_to(base / "open")
    assert why_not_private(base / "link") == f"{base / 'open'} has mode 0750, not 0700"
    base.chmod(0o1777)  # sticky: others cannot rename or remove our entries
    assert why_not_private(base / "mine") is None
    base.chmod(0o777)
    assert why_not_private(base / "mine") == f"{base} has mode 0777: others can write it"
    base.chmod(0o775)
    assert why_not_private(base / "mine") == f"{base} has mode 0775: others can write it"
    base.chmod(0o755)
    if os.geteuid() == 0:  # giving a folder to another user needs root
        os.chown(base / "mine", 12345, 12345)
        assert why_not_private(base / "mine") == f"{base / 'mine'} belongs to uid 12345, not 0"


def plant(root: Path, key: ObjectKey, payload: bytes, secret: bytes) -> None:
    """Write ``key``'s object file as a store keyed by ``secret`` writes it."""
    with TieredStore(StoreConfig("n1", ssd_dir=root, retention=RetentionPolicy(ram_capacity_bytes=0)),
                     FP, secret=secret) as store:
        store.put(key, payload)
        assert store.flush(10)


@pytest.mark.parametrize("folder_mode", [0o700, 0o770, 0o777])
def test_ssd_reads_check_the_mac_unless_only_the_stores_user_can_write(tmp_path: Path, folder_mode: int) -> None:
    """In a private folder tree only the store's user (who can read the secret) or root
    can have written a file, and reads check the checksum; where others can write any
    folder on the way, reads check the MAC, and a file planted without the secret is a
    miss. Damage is caught either way."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    root.chmod(folder_mode)
    secret, forged = b"s" * 32, b"f" * 32
    values = [bytes([i]) * 20_000 for i in range(3)]
    plant(root, KEYS[0], values[0], forged)  # well formed, checksum right, MAC keyed otherwise
    plant(root, KEYS[1], values[1], secret)
    plant(root, KEYS[2], values[2], secret)
    damaged = next((root / "objects").rglob(f"{KEYS[2].hex}.chunk"))
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 1
    damaged.write_bytes(data)
    private = folder_mode == 0o700
    with TieredStore(StoreConfig("n1", ssd_dir=root, retention=RetentionPolicy(ram_capacity_bytes=0)),
                     FP, secret=secret) as store:
        assert store.get_many(KEYS[:3]) == [values[0] if private else None, values[1], None]
        assert store.stats().tiers["ssd"].corrupt == (1 if private else 2)
