"""Multi-process faults on the SSD tier: a writer killed before its rename, writers racing.

Each test runs real Python processes on one store directory and then checks that no
wrong bytes are ever read, nothing crashes, and a reopened store heals the directory.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from storage.keys import Fingerprint, chunk_keys
from storage.policy import RetentionPolicy
from storage.store import StoreConfig, TieredStore

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FP = Fingerprint.of("tiny", {"layers": 4})
KEY = chunk_keys(FP, range(64), 64)[0]
OLD, NEW = b"old" * 20_000, b"new" * 20_000

# A child process on store directory ROOT. Mode "pause": once the file GO exists, put
# NEW through a writer that stops after writing the temp file (before the rename) and
# announces it by creating READY (READY.opened once its store is open). Modes "A"/"B": put and remove the key in a loop.
CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from storage.keys import Fingerprint, chunk_keys
    from storage.policy import RetentionPolicy
    from storage.store import StoreConfig, TieredStore
    from storage.ssd_tier import write_all

    root, ready, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    fp = Fingerprint.of("tiny", {"layers": 4})
    key = chunk_keys(fp, range(64), 64)[0]

    def paused_write(fd, buffers):
        write_all(fd, buffers)
        ready.touch()
        time.sleep(600)  # killed here: the temp file is written, not renamed

    config = StoreConfig("child", ssd_dir=root, retention=RetentionPolicy(ram_capacity_bytes=0))
    if mode == "pause":
        store = TieredStore(config, fp, ssd_write=paused_write)  # indexes the files before GO
        Path(str(ready) + ".opened").touch()
        while not Path(sys.argv[4]).exists():
            time.sleep(0.01)
        store.put(key, b"new" * 20_000)
        time.sleep(600)
    else:  # race: write and remove one key with this process's own bytes, as fast as possible
        value = (b"A" if mode == "A" else b"B") * 60_000
        with TieredStore(config, fp) as store:
            ready.touch()
            deadline = time.monotonic() + float(sys.argv[4])
            while time.monotonic() < deadline:
                store.put(key, value)
                store.flush()
                store.remove(key)
""")


def spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", CHILD, *args], cwd=REPO)


def wait_for_file(path: Path, process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, "child died early"
        assert time.monotonic() < deadline, "child never got there"
        time.sleep(0.01)


def open_store(root: Path) -> TieredStore:
    return TieredStore(StoreConfig("n1", ssd_dir=root, retention=RetentionPolicy(ram_capacity_bytes=0)), FP)


@pytest.mark.slow
@pytest.mark.parametrize("had_old_value", [False, True])
def test_a_writer_killed_between_write_and_rename(tmp_path: Path, had_old_value: bool) -> None:
    child = spawn(str(tmp_path), str(tmp_path / "ready"), "pause", str(tmp_path / "go"))
    try:
        wait_for_file(tmp_path / "ready.opened", child)  # the child's index does not know OLD
        if had_old_value:
            with open_store(tmp_path) as store:
                store.put(KEY, OLD)
        (tmp_path / "go").touch()
        wait_for_file(tmp_path / "ready", child)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    [temp] = tmp_path.rglob("*.tmp")
    assert temp.stat().st_size > len(NEW)  # the whole new object sat there, unrenamed
    with open_store(tmp_path) as store:
        assert store.get(KEY) == (OLD if had_old_value else None)
        store.gc()
        assert not list(tmp_path.rglob("*.tmp"))  # its writer is dead: debris
        if not had_old_value:
            store.put(KEY, NEW)
            store.flush()
            assert store.get(KEY) == NEW


@pytest.mark.slow
def test_two_processes_racing_on_one_key_never_show_torn_bytes(tmp_path: Path) -> None:
    seconds = "2.0"
    writers = [spawn(str(tmp_path), str(tmp_path / f"ready{m}"), m, seconds) for m in "AB"]
    for mode, writer in zip("AB", writers):
        wait_for_file(tmp_path / f"ready{mode}", writer)
    allowed = {None, b"A" * 60_000, b"B" * 60_000}
    reads = seen = 0
    while any(w.poll() is None for w in writers):
        with open_store(tmp_path) as reader:  # a fresh scan sees the other processes' files
            value = reader.get(KEY)
            assert reader.stats().tiers["ssd"].corrupt == 0
        assert value in allowed
        reads += 1
        seen += value is not None
    assert [w.wait() for w in writers] == [0, 0]
    assert reads > 5 and seen > 0
    with open_store(tmp_path) as store:
        assert store.get(KEY) in allowed
        store.gc()
        assert store.stats().tiers["ssd"].corrupt == 0
    assert not list(tmp_path.rglob("*.tmp"))
