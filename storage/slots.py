"""Which SSD directory a node's store owns: the same one after every restart.

An ``ssd_dir`` with ``{node}`` in it names a parent directory whose subdirectories are
*slots*: one per store that runs on this machine at a time. A store claims a slot by
holding an exclusive ``flock`` on the slot's ``owner.lock`` for as long as its
process lives, so the claim ends with the process however it ends (a crash, SIGKILL,
a Ray restart), and the next store on the machine takes the same slot and its files.

Which slot: the one named by the configured node name if there is one; else the
free slot used most recently (a restart gets its own cache back; a directory named
after a Ray node id by older versions counts as a slot too, and is adopted); else a
new one (``node-0``, ``node-1``, ...). Two stores on one machine (two raylets)
get two slots. A store marks its slot in use while it lives (``Slot.touch``); free
slots whose mark is older than the retention hold only expired files and are deleted.

An ``ssd_dir`` without ``{node}`` is used as it is, unlocked (shared if two stores are
given the same one: each reads the other's files as misses until it restarts).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

PLACEHOLDER = "{node}"
_LOCK = "owner.lock"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class SlotError(RuntimeError):
    """The slot's directory cannot be created or locked."""


@dataclass
class Slot:
    """A claimed SSD directory; ``release`` (or the process's end) frees it."""

    path: Path
    _fd: int | None = None

    def touch(self) -> None:
        """Mark the slot in use now (its owner does this while it lives: a slot whose
        last mark is older than the retention holds only expired files)."""
        if self._fd is not None:
            os.utime(self._fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _try_lock(directory: Path) -> int | None:
    """An fd holding ``directory``'s exclusive lock, or None if a live process holds it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise SlotError(f"cannot use {directory}: {error.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.utime(fd)  # the slot's last use: the most recent free slot is adopted first
    os.truncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _last_use(directory: Path) -> float:
    for path in (directory / _LOCK, directory / "objects", directory):
        try:
            return path.stat().st_mtime
        except OSError:
            continue
    return 0.0


def claim(ssd_dir: str, node_name: str | None = None, *, collect_after_s: float | None = None) -> Slot:
    """The directory a store should use for ``ssd_dir`` (see the module's docstring),
    locked for this process. ``collect_after_s``: delete free slots whose last claim is
    older than this."""
    if PLACEHOLDER not in ssd_dir:
        return Slot(Path(ssd_dir))
    if node_name is not None and not _NAME.match(node_name):
        raise SlotError(f"invalid node name {node_name!r}: letters, digits, '_', '.', '-'")
    head, _, tail = ssd_dir.partition(PLACEHOLDER)
    if PLACEHOLDER in tail:
        raise SlotError(f"ssd_dir {ssd_dir!r}: {PLACEHOLDER} may appear once")
    parent_text, _, before = head.rpartition("/")
    after, slash, suffix = tail.partition("/")
    parent = Path(parent_text or ("/" if head.startswith("/") else "."))

    def top(name: str) -> Path:  # the slot's directory under ``parent``
        return parent / f"{before}{name}{after}"

    def place(name: str) -> Path:  # where the store keeps its files in it
        return top(name) / suffix if slash else top(name)

    def slot_name(entry_name: str) -> str | None:
        """The slot name of a directory under ``parent``, if its name fits the pattern."""
        if not (entry_name.startswith(before) and entry_name.endswith(after)):
            return None
        name = entry_name[len(before): len(entry_name) - len(after)]
        return name if _NAME.match(name) else None

    try:
        names = [slot_name(entry.name) for entry in parent.iterdir() if entry.is_dir()]
    except FileNotFoundError:
        names = []
    existing = sorted((name for name in names if name is not None), key=lambda name: -_last_use(place(name)))
    if node_name is not None:  # a configured name: that slot, and no other
        fd = _try_lock(place(node_name))
        if fd is None:
            raise SlotError(f"{place(node_name)} is in use by another store on this machine")
        chosen = Slot(place(node_name), fd)
    else:
        chosen = _free_slot(existing, place)
    if collect_after_s is not None:
        now = time.time()
        for name in existing:
            if place(name) != chosen.path and now - _last_use(place(name)) > collect_after_s:
                _collect(top(name), place(name))
    return chosen


def _free_slot(existing: list[str], place) -> Slot:
    """The most recently used free slot of ``existing``, else a new one."""
    for name in existing:
        fd = _try_lock(place(name))
        if fd is not None:
            return Slot(place(name), fd)
    taken = set(existing)
    for number in range(len(taken) + 1):
        name = f"node-{number}"
        if name not in taken:
            fd = _try_lock(place(name))
            if fd is not None:
                return Slot(place(name), fd)
    name = f"node-{os.getpid()}"  # every name raced away: a unique one
    fd = _try_lock(place(name))
    if fd is None:
        raise SlotError(f"no free slot for {place('*')}")
    return Slot(place(name), fd)


def _collect(top: Path, slot: Path) -> None:
    """Delete a free slot (everything in it has expired); one in use is left alone."""
    fd = _try_lock(slot)
    if fd is None:
        return
    try:
        shutil.rmtree(top, ignore_errors=True)
    finally:
        os.close(fd)
