"""SSD slots: a store gets the same directory after a restart, two stores on one
machine get two, only directories the store marked are slots, stale free ones go."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.slots import SlotError, claim

pytestmark = pytest.mark.integration


def test_a_restarted_store_gets_its_own_slot_back(tmp_path: Path) -> None:
    template = str(tmp_path / "cache" / "{node}")
    first = claim(template)
    assert first.path == tmp_path / "cache" / "node-0"
    (first.path / "objects").mkdir()
    first.release()  # the process ended
    again = claim(template)
    assert again.path == first.path


def test_two_live_stores_on_one_machine_get_two_slots(tmp_path: Path) -> None:
    template = str(tmp_path / "ssd-{node}")
    a, b = claim(template), claim(template)
    assert {a.path.name, b.path.name} == {"ssd-node-0", "ssd-node-1"}
    a.release()
    assert claim(template).path == a.path  # a's slot is free again; b's is not


def test_the_lock_ends_with_the_process(tmp_path: Path) -> None:
    """A store killed with SIGKILL leaves its slot free: flock dies with the process."""
    template = str(tmp_path / "{node}")
    code = ("import sys, time; from storage.slots import claim; s = claim(sys.argv[1]); "
            "print(s.path, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, template], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        held = Path(child.stdout.readline().strip())
        assert claim(template).path != held  # taken while the child lives
    finally:
        child.kill()
        child.wait()
    assert claim(template).path == held


def test_marked_free_slots_are_adopted_most_recent_first_and_older_layouts_left_alone(tmp_path: Path) -> None:
    """Older versions named the directory after the Ray node id and wrote no marker:
    such a directory is not a slot, however well its name fits."""
    template = str(tmp_path / "{node}")
    old, older = claim(template), claim(template)
    for slot, age in ((old, 100), (older, 5000)):
        slot.release()
        stamp = time.time() - age
        os.utime(slot.path / "owner.lock", (stamp, stamp))
    legacy = tmp_path / "9f1c2d3e4b5a"
    (legacy / "objects" / "ab").mkdir(parents=True)
    assert claim(template).path == old.path
    assert claim(template).path == older.path
    assert claim(template).path == tmp_path / "node-2"  # a new one: the legacy directory is not taken
    assert sorted(p.name for p in legacy.rglob("*")) == ["ab", "objects"]


def test_a_configured_node_name_is_its_slot_and_nobody_elses(tmp_path: Path) -> None:
    template = str(tmp_path / "{node}" / "cache")
    slot = claim(template, "gpu-07")
    assert slot.path == tmp_path / "gpu-07" / "cache"
    with pytest.raises(SlotError, match="in use"):
        claim(template, "gpu-07")
    with pytest.raises(SlotError, match="invalid node name"):
        claim(template, "../etc")


def test_free_slots_past_retention_are_collected(tmp_path: Path) -> None:
    template = str(tmp_path / "{node}")
    stale, fresh = claim(template), claim(template)
    for slot in (stale, fresh):
        (slot.path / "objects").mkdir()
        slot.release()
    long_ago = time.time() - 10 * 86400
    os.utime(stale.path / "owner.lock", (long_ago, long_ago))
    kept = claim(template, collect_after_s=72 * 3600)
    assert kept.path == fresh.path  # the most recent free slot
    assert not stale.path.exists()
    busy = claim(template)  # a slot in use is never collected, however old
    os.utime(busy.path / "owner.lock", (long_ago, long_ago))
    claim(template, "other", collect_after_s=72 * 3600)
    assert busy.path.exists()


def test_a_directory_without_placeholder_is_used_as_given(tmp_path: Path) -> None:
    assert claim(str(tmp_path / "fixed")).path == tmp_path / "fixed"
    with pytest.raises(SlotError, match="once"):
        claim(str(tmp_path / "{node}" / "{node}"))
