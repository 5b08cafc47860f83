"""Which SSD directory a node's store owns: the same one after every restart, and
nothing it did not make itself.

An ``ssd_dir`` with ``{node}`` in it names a parent directory whose subdirectories are
*slots*: one per store that runs on this machine at a time. A slot is a directory that
holds the store's own marker, ``v41-slot.json`` (``{"kind": "v41-ssd-slot", "format":
1, "created": <unix time>}``, written 0600 by the store that made the directory, before
anything else). A directory without a valid marker is not a slot whatever its name: it
is never adopted, written into or deleted (older versions took any directory whose
name fitted, named after a Ray node id or not, and deleted the stale ones: a user's
``photos/`` beside the cache went). Directories of older versions carry no marker, so
they are left as they are; their cache is simply not reused.

A store claims a slot by holding an exclusive ``flock`` on the slot's ``owner.lock``
for as long as its process lives, so the claim ends with the process however it ends
(a crash, SIGKILL, a Ray restart), and the next store on the machine takes the same
slot and its files. Which slot: the one named by the configured node name if there is
one; else the marked free slot used most recently (a restart gets its own cache back);
else a new one (``node-0``, ``node-1``, ...). Two stores on one machine (two raylets)
get two slots. A store marks its slot in use while it lives (``Slot.touch``); marked
free slots whose mark is older than the retention hold only expired files and are
deleted.

Everything made here is private: folders 0700, files 0600 (modes given to ``mkdir`` and
``open``, which the umask can only narrow). The slots' parent must be this user's and
writable by nobody else, or the claim is refused: a folder another user made first
(under ``/tmp``, say) could otherwise hold planted objects or see ours.

``v41 serve --cache-dir D`` lays its slots in ``D/v41-slots/{node}`` (:func:`slots_template`),
so ``D`` may be a folder with other things in it; the default ``D`` is the user's cache
folder, ``$XDG_CACHE_HOME/v41`` (``~/.cache/v41``; :func:`default_ssd_dir`).

An ``ssd_dir`` without ``{node}`` is used as it is, unlocked (shared if two stores are
given the same one: each reads the other's files as misses until it restarts); it must
be missing (it is made and marked), marked, or empty.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from storage.private import PRIVATE_DIR, PRIVATE_FILE, make_private_dirs, write_private

PLACEHOLDER = "{node}"
SLOTS_FOLDER = "v41-slots"  # the dedicated folder `--cache-dir` lays its slots in
MARKER = "v41-slot.json"
MARKER_KIND = "v41-ssd-slot"
MARKER_FORMAT = 1
_LOCK = "owner.lock"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MARKER_MAX_BYTES = 4096


class SlotError(RuntimeError):
    """The slot's directory cannot be created, trusted or locked."""


# -- where the cache lives -------------------------------------------------------------


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/v41``, else ``~/.cache/v41``: the user's own cache folder, never a
    shared one such as ``/tmp`` (another user could make it first and own it). A relative
    ``XDG_CACHE_HOME`` is ignored, as the XDG spec says."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "v41"


def slots_template(cache_dir: Path | str) -> str:
    """The ``ssd_dir`` for a cache folder: its slots in a dedicated subfolder, so that
    nothing else in ``cache_dir`` is ever taken for a slot."""
    return str(Path(cache_dir) / SLOTS_FOLDER / PLACEHOLDER)


def default_ssd_dir() -> str:
    """The default ``ssd_dir`` (the app config's and `v41 serve`'s)."""
    return slots_template(cache_home())


def default_secret_file() -> Path:
    """Where the cluster's secret is made when none is named (`v41 serve`'s, the router's)."""
    return cache_home() / "cache-secret"


# -- private folders and files ----------------------------------------------------------


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_private(directory: Path) -> None:
    """Refuse a folder that another user owns or may write into: what is in it could be
    planted, and what the store writes there could be replaced or read."""
    try:
        link, info = os.lstat(directory), os.stat(directory)
    except OSError as error:
        raise SlotError(f"cannot use {directory}: {error.strerror}") from None
    me = os.geteuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid != me:
        raise SlotError(f"refusing {directory}: a symlink owned by {_owner(link.st_uid)}, not by this user")
    if not stat.S_ISDIR(info.st_mode):
        raise SlotError(f"cannot use {directory}: not a directory")
    if info.st_uid != me:
        raise SlotError(f"refusing {directory}: owned by {_owner(info.st_uid)}, not by this user "
                        f"({_owner(me)}); give --cache-dir / ssd_dir a folder of your own")
    if info.st_mode & 0o022:
        raise SlotError(f"refusing {directory}: writable by other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                        f"`chmod go-w {directory}` or give another folder")


def _write_marker(directory: Path) -> None:
    """Mark ``directory`` as a slot (the marker whole or absent)."""
    body = json.dumps({"kind": MARKER_KIND, "format": MARKER_FORMAT, "created": time.time()}).encode()
    write_private(directory / MARKER, body)


def is_marked(directory: Path) -> bool:
    """Whether ``directory`` is a slot: a real directory of this user holding a marker of
    this user that is JSON of the marker's shape. Anything else reads as unmarked."""
    me = os.geteuid()
    try:
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != me:
            return False
        fd = os.open(directory / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            marker = os.fstat(fd)
            if not stat.S_ISREG(marker.st_mode) or marker.st_uid != me:
                return False
            document = json.loads(os.read(fd, _MARKER_MAX_BYTES))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return False
    created = document.get("created") if isinstance(document, dict) else None
    return (isinstance(document, dict) and document.get("kind") == MARKER_KIND
            and type(document.get("format")) is int and document["format"] == MARKER_FORMAT
            and isinstance(created, (int, float)) and not isinstance(created, bool))


# -- slots --------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class _Template:
    """``ssd_dir`` split around ``{node}``: ``parent/before{node}after[/suffix]``."""

    parent: Path
    before: str
    after: str
    suffix: str

    @classmethod
    def parse(cls, ssd_dir: str) -> _Template:
        head, _, tail = ssd_dir.partition(PLACEHOLDER)
        if PLACEHOLDER in tail:
            raise SlotError(f"ssd_dir {ssd_dir!r}: {PLACEHOLDER} may appear once")
        parent_text, _, before = head.rpartition("/")
        after, _, suffix = tail.partition("/")
        return cls(Path(parent_text or ("/" if head.startswith("/") else ".")), before, after, suffix)

    def top(self, name: str) -> Path:
        """The slot's directory under ``parent``: the one marked, locked and collected."""
        return self.parent / f"{self.before}{name}{self.after}"

    def place(self, name: str) -> Path:
        """Where the store keeps its files in the slot."""
        return self.top(name) / self.suffix if self.suffix else self.top(name)

    def name_of(self, entry_name: str) -> str | None:
        """The slot name of a directory under ``parent``, if its name fits the pattern."""
        if not (entry_name.startswith(self.before) and entry_name.endswith(self.after)):
            return None
        name = entry_name[len(self.before): len(entry_name) - len(self.after)]
        return name if _NAME.match(name) else None


def _try_lock(top: Path) -> int | None:
    """An fd holding the slot's exclusive lock, or None if a live process holds it."""
    try:
        fd = os.open(top / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
    except OSError as error:
        raise SlotError(f"cannot use {top}: {error.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.utime(fd)  # the slot's last use: the most recent free slot is adopted first
    os.truncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _last_use(template: _Template, name: str) -> float:
    top = template.top(name)
    for path in (top / _LOCK, template.place(name) / "objects", top / MARKER, top):
        try:
            return path.stat().st_mtime
        except OSError:
            continue
    return 0.0


def _open_slot(template: _Template, name: str, *, new: bool) -> Slot | None:
    """The slot ``name`` locked for this process; None if a live store holds it, or (``new``)
    if the directory appeared meanwhile. ``new``: make the directory and mark it first;
    else it must be marked already (checked again here, just before it is used)."""
    top = template.top(name)
    try:
        if new:
            os.mkdir(top, PRIVATE_DIR)
        elif not is_marked(top):
            return None
    except FileExistsError:
        return None
    except OSError as error:
        raise SlotError(f"cannot use {top}: {error.strerror}") from None
    if new:
        try:
            _write_marker(top)
        except OSError as error:
            shutil.rmtree(top, ignore_errors=True)  # made just now, by this process: nobody else's
            raise SlotError(f"cannot mark {top}: {error.strerror}") from None
    fd = _try_lock(top)
    if fd is None:
        return None
    try:
        make_private_dirs(template.place(name))
    except OSError as error:
        os.close(fd)
        raise SlotError(f"cannot use {template.place(name)}: {error.strerror}") from None
    return Slot(template.place(name), fd)


def _entries(template: _Template) -> tuple[set[str], list[str]]:
    """Every slot-shaped name taken under the parent, and the marked slots among them,
    most recently used first."""
    try:
        with os.scandir(template.parent) as scan:
            names = {name for entry in scan if (name := template.name_of(entry.name)) is not None}
    except FileNotFoundError:
        names = set()
    marked = [name for name in names if is_marked(template.top(name))]
    return names, sorted(marked, key=lambda name: -_last_use(template, name))


def claim(ssd_dir: str, node_name: str | None = None, *, collect_after_s: float | None = None) -> Slot:
    """The directory a store should use for ``ssd_dir`` (see the module's docstring),
    locked for this process. ``collect_after_s``: delete marked free slots whose last
    claim is older than this."""
    if PLACEHOLDER not in ssd_dir:
        return _fixed(Path(ssd_dir))
    if node_name is not None and not _NAME.match(node_name):
        raise SlotError(f"invalid node name {node_name!r}: letters, digits, '_', '.', '-'")
    template = _Template.parse(ssd_dir)
    try:
        make_private_dirs(template.parent)
    except OSError as error:
        raise SlotError(f"cannot create {template.parent}: {error.strerror}") from None
    check_private(template.parent)
    taken, marked = _entries(template)
    if node_name is not None:  # a configured name: that slot, and no other
        chosen = _named_slot(template, node_name, node_name in taken)
    else:
        chosen = _free_slot(template, taken, marked)
    if collect_after_s is not None:
        now = time.time()
        for name in marked:
            if template.place(name) != chosen.path and now - _last_use(template, name) > collect_after_s:
                _collect(template.top(name))
    return chosen


def _named_slot(template: _Template, name: str, exists: bool) -> Slot:
    top = template.top(name)
    if exists and not is_marked(top):
        raise SlotError(f"{top} exists and is not a v41 cache slot (no {MARKER} of this user in it): "
                        "it is left alone; move it or name the node otherwise")
    slot = _open_slot(template, name, new=not exists)
    if slot is None:
        raise SlotError(f"{template.place(name)} is in use by another store on this machine")
    return slot


def _free_slot(template: _Template, taken: set[str], marked: list[str]) -> Slot:
    """The most recently used free marked slot, else a new one under a name nobody took."""
    for name in marked:
        slot = _open_slot(template, name, new=False)
        if slot is not None:
            return slot
    for number in range(len(taken) + 1):
        name = f"node-{number}"
        if name not in taken and (slot := _open_slot(template, name, new=True)) is not None:
            return slot
    name = f"node-{os.getpid()}"  # every name raced away: a unique one
    slot = _open_slot(template, name, new=True) if name not in taken else None
    if slot is None:
        raise SlotError(f"no free slot for {template.place('*')}")
    return slot


def _fixed(directory: Path) -> Slot:
    """An ``ssd_dir`` without ``{node}``: unlocked, used as given if it is this user's
    and private, and either made here (then marked), marked already, or empty."""
    try:
        if not os.path.lexists(directory):
            make_private_dirs(directory.parent)
            os.mkdir(directory, PRIVATE_DIR)
            _write_marker(directory)
            return Slot(directory)
        check_private(directory)
        if not is_marked(directory):
            if any(directory.iterdir()):
                raise SlotError(f"{directory} holds files that are not a v41 cache (no {MARKER} in it): "
                                "give ssd_dir a new or empty folder, or one with {node} in it")
            _write_marker(directory)
    except FileExistsError:
        return _fixed(directory)  # made meanwhile: check it as an existing one
    except OSError as error:
        raise SlotError(f"cannot use {directory}: {error.strerror}") from None
    return Slot(directory)


def _collect(top: Path) -> None:
    """Delete a marked free slot (everything in it has expired); one in use is left alone."""
    if not is_marked(top):
        return
    fd = _try_lock(top)
    if fd is None:
        return
    try:
        shutil.rmtree(top, ignore_errors=True)
    finally:
        os.close(fd)
