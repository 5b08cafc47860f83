"""Local SSD tier: one file per object, written atomically, kept 72 h after last use.

Layout: ``ROOT/objects/ab/cd/<64 hex digits>.<kind>`` where ``abcd`` are the first hex
digits of the key (a two-level fan-out keeps directories small) and the kind names the
retention too (``.chunk``, ``.chunk-24h``: a restart's scan knows each file's time from
its name). Names come only from key digests, never from user input.

Files are created 0600 and folders 0700 (the modes given to ``open`` and ``mkdir``, which
the umask can only narrow): a cache holds users' conversations.

Writes go to a temp file in the same directory (``.<hex>.<pid>.<n>.tmp``), are fsynced
as the ``FsyncPolicy`` says, get their last-use time as mtime, and are renamed over the
final name, so a reader sees the old file, the new file or none, never a torn one. A
writer killed before the rename leaves only a temp file, which GC removes once its
process is gone (or after ``temp_grace_s``).

A read checks the header and the payload's checksum (storage/codec.py), and the keyed MAC
instead where the folder is not private (``why_not_private``: ours, 0700, and no one
else can write any folder above it): in a private folder only the store's own user,
who can read the cluster's secret, or root can have written a file, so the MAC would
catch nothing the checksum does not, and it costs a 16 KiB read a third of its time.
Either way a file is bound to its name, and a torn or flipped one reads as a miss.

Last use is the file's mtime, set from the store's clock. The in-memory index holds
the exact time; a read rewrites the mtime only when it is ``touch_interval_s`` stale,
so a read is one open, one pread (two above 32 KiB, so the payload is read straight
into the bytes returned) and one close; no stat. After a restart the index is rebuilt from a
scan of the files (name, size, mtime); headers and payloads are verified on each read.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from storage.codec import HEADER_BYTES, Codec, CorruptObject
from storage.keys import Kind, ObjectKey
from storage.metrics import TierCounters
from storage.policy import FsyncPolicy, RetentionPolicy, TierName
from storage.private import PRIVATE_FILE, make_private_dirs, why_not_private
from storage.tier import LocalTier, OnDrop, payload_size
from storage.sized import SizedPayload

WriteFile = Callable[[int, Sequence[bytes]], None]

_SUFFIX = {Kind.CHUNK: ".chunk", Kind.WINDOW: ".window", Kind.RESPONSE: ".response",
           Kind.CONVERSATION: ".conversation", Kind.CHUNK_24H: ".chunk-24h", Kind.WINDOW_24H: ".window-24h",
           Kind.CHUNK_IN_MEMORY: ".chunk-ram", Kind.WINDOW_IN_MEMORY: ".window-ram"}  # (the last two: never here)
_KIND_OF_SUFFIX = {suffix: kind for kind, suffix in _SUFFIX.items()}
_TEMP_SUFFIX = ".tmp"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_ONE_READ_BYTES = 32 << 10  # up to this file size a read is one pread plus a small slice

logger = logging.getLogger(__name__)


def write_all(fd: int, buffers: Sequence[bytes]) -> None:
    """Write every buffer to ``fd`` in order (the default writer; tests wrap it to inject faults)."""
    for buffer in buffers:
        view = memoryview(buffer)
        while view:
            view = view[os.write(fd, view):]


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Entry:
    __slots__ = ("kind", "size", "last_used", "stamped")

    def __init__(self, kind: Kind, size: int, last_used: float, stamped: float) -> None:
        self.kind = kind
        self.size = size  # file bytes, header included
        self.last_used = last_used  # exact, from the store's clock
        self.stamped = stamped  # the file's mtime


class SsdTier(LocalTier):
    """Files under one directory, owned by one store process.

    Another process may share the directory (it sees misses for files it has not
    indexed, never wrong bytes), but only the owner's GC and capacity limits apply.
    """

    name = TierName.SSD

    def __init__(self, root: Path, codec: Codec, policy: RetentionPolicy, clock: Callable[[], float],
                 counters: TierCounters, on_drop: OnDrop, write_file: WriteFile = write_all) -> None:
        objects = Path(root) / "objects"
        make_private_dirs(objects)
        # The real folder, whose privacy is checked once: no link on the way can be swapped later.
        self._dir = Path(os.path.realpath(objects))
        self._prefix = str(self._dir)  # paths are built as strings: pathlib costs more than a read
        not_private = why_not_private(self._dir)
        self.verifies_mac = not_private is not None
        if not_private is not None:
            logger.warning("SSD tier: reads check the keyed MAC, not the faster checksum, because %s", not_private)
        self._codec = codec
        self._policy = policy
        # Seconds per kind kept here (a kind not in it is not kept: V4.1's window states).
        self._retention: dict[Kind, float] = {
            kind: retention for kind in Kind if (retention := policy.retention_s(kind, TierName.SSD)) is not None}
        self._clock = clock
        self._counters = counters
        self._on_drop = on_drop
        self._write_file = write_file
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # digest -> entry, least recently used first
        self._bytes = 0
        self._made_dirs: set[str] = set()
        self._temp_ids = itertools.count()
        self._scan()

    # -- paths and index ---------------------------------------------------------------

    def _path(self, hex_digest: str, kind: Kind) -> str:
        return f"{self._prefix}/{hex_digest[:2]}/{hex_digest[2:4]}/{hex_digest}{_SUFFIX[kind]}"

    def _scan(self) -> None:
        """Rebuild the index from the files; delete those whose retention ran out."""
        now = self._clock()
        uid = os.geteuid()
        found: list[tuple[float, bytes, _Entry]] = []
        for path in self._walk():
            name = os.path.basename(path)
            if name.startswith("."):
                continue  # temp files: GC decides
            stem, dot, suffix = name.partition(".")
            kind = _KIND_OF_SUFFIX.get(dot + suffix)
            if kind is None:
                continue  # not ours
            try:
                key = ObjectKey.from_hex(kind, stem)
                stat = os.stat(path)
            except (ValueError, OSError):
                continue  # not ours, or gone meanwhile
            if path != self._path(key.hex, kind) or stat.st_uid != uid:
                continue  # another user's file: not ours to read or delete
            retention = self._retention.get(kind)
            if retention is None or now - stat.st_mtime > retention:
                self._unlink(path)
                self._counters.add(expirations=1)
                continue
            found.append((stat.st_mtime, key.digest, _Entry(kind, stat.st_size, stat.st_mtime, stat.st_mtime)))
        found.sort(key=lambda item: item[0])
        with self._lock:
            for _, digest, entry in found:
                self._index[digest] = entry
                self._bytes += entry.size

    def _walk(self) -> list[str]:
        files: list[str] = []
        for first in os.scandir(self._dir):
            if not first.is_dir(follow_symlinks=False):
                continue
            for second in os.scandir(first.path):
                if second.is_dir(follow_symlinks=False):
                    files.extend(f.path for f in os.scandir(second.path) if f.is_file(follow_symlinks=False))
        return files

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _delete(self, key: ObjectKey, kind: Kind) -> None:
        """Remove the object's file (the medium's part of a drop)."""
        self._unlink(self._path(key.hex, kind))

    def _drop(self, key: ObjectKey, entry: _Entry, reason: str | None) -> None:
        """Forget ``entry`` (if still current) and delete its file; ``reason`` names the counter."""
        with self._lock:
            if self._index.get(key.digest) is entry:
                del self._index[key.digest]
                self._bytes -= entry.size
        self._delete(key, entry.kind)
        if reason:
            self._counters.add(**{reason: 1})
        self._on_drop(key)

    # -- Tier --------------------------------------------------------------------------

    def contains(self, key: ObjectKey) -> bool:
        with self._lock:
            entry = self._index.get(key.digest)
        return (entry is not None and entry.kind is key.kind
                and self._clock() - entry.last_used <= self._retention[entry.kind])

    def get(self, key: ObjectKey) -> bytes | None:
        return self.get_many((key,))[0]

    def get_many(self, keys: Sequence[ObjectKey]) -> list[bytes | None]:
        now = self._clock()
        retention = self._retention
        claimed: list[tuple[int, ObjectKey, _Entry]] = []
        expired: list[tuple[ObjectKey, _Entry]] = []
        # One lock round claims every use before the I/O: a failed read drops its entry anyway.
        with self._lock:
            index = self._index
            for i, key in enumerate(keys):
                entry = index.get(key.digest)
                if entry is None or entry.kind is not key.kind:
                    continue
                if now - entry.last_used > retention[entry.kind]:
                    expired.append((key, entry))
                    continue
                entry.last_used = now
                index.move_to_end(key.digest)
                claimed.append((i, key, entry))
        for key, entry in expired:
            self._drop(key, entry, "expirations")
        results: list[bytes | None] = [None] * len(keys)
        hits = hit_bytes = 0
        for i, key, entry in claimed:
            payload = self._read(key, entry, now)
            if payload is not None:
                results[i] = payload
                hits += 1
                hit_bytes += payload_size(payload)
        self._counters.reads(hits, len(keys) - hits, hit_bytes)
        return results

    def _read(self, key: ObjectKey, entry: _Entry, now: float) -> bytes | None:
        """The verified payload of a claimed entry's file, or None (the entry is then dropped)."""
        path = self._path(key.hex, entry.kind)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._drop(key, entry, None)  # deleted behind our back: heal the index
            return None
        codec = self._codec
        mac = self.verifies_mac
        try:
            # Read one byte past the expected end: getting it means trailing junk.
            if entry.size <= _ONE_READ_BYTES:  # one syscall; copying the payload out is cheaper than a second
                data = os.pread(fd, entry.size + 1, 0)
                payload = codec.check(key, data, 0, mac).tobytes()
            else:  # two syscalls, so that the payload is read straight into the bytes returned
                header = codec.check_header(key, os.pread(fd, HEADER_BYTES, 0))
                payload = os.pread(fd, header[0] + 1, HEADER_BYTES)
                codec.check_payload(key, header, payload, mac)
        except (CorruptObject, OSError):
            self._drop(key, entry, "corrupt")
            return None
        finally:
            os.close(fd)
        if now - entry.stamped >= self._policy.touch_interval_s:
            try:
                os.utime(path, (now, now))
                entry.stamped = now
            except OSError:
                pass  # a later read retries; the in-memory time is still exact
        return payload

    def put(self, key: ObjectKey, payload: bytes, replace: bool = False) -> bool:
        """``replace``: the key's bytes changed (the retention lab's extents grow under
        one key): a stored copy is rewritten, as a ``remove`` then ``put`` would, instead
        of counting as a use. Its file is overwritten in place, or deleted if the write fails."""
        if key.kind not in self._retention:
            return False
        now = self._clock()
        replaced = None
        with self._lock:
            entry = self._index.get(key.digest)
            if entry is not None and entry.kind is key.kind:
                if replace:
                    replaced = self._index.pop(key.digest)
                    self._bytes -= replaced.size
                elif now - entry.last_used <= self._retention[key.kind]:
                    # Same key, same tokens, same model: the bytes are already here.
                    entry.last_used = now
                    self._index.move_to_end(key.digest)
                    return True
        size = HEADER_BYTES + payload_size(payload)
        capacity = self._policy.ssd_capacity_bytes
        fits = capacity is None or size <= capacity
        if fits and capacity is not None:
            self._evict(self._bytes + size - capacity)
        if not (fits and self._write(key, payload, size, now)):
            self._counters.add(write_errors=1)
            if replaced is not None:  # the old copy is stale: it goes
                self._delete(key, replaced.kind)
                self._on_drop(key)
            return False
        with self._lock:
            old = self._index.pop(key.digest, None)
            self._bytes += size - (old.size if old else 0)
            self._index[key.digest] = _Entry(key.kind, size, now, now)
        self._counters.writes(1, size)
        return True

    def _write(self, key: ObjectKey, payload: bytes, size: int, now: float) -> bool:
        """Put the object's file in place (the medium's part of a put); False if it could
        not be written, even after evicting to make room on a full disk."""
        header = self._codec.header(key, payload)
        path = self._path(key.hex, key.kind)
        for _ in range(4):
            try:
                self._write_atomic(path, header, payload, now)
                return True
            except OSError as error:
                if error.errno in _DISK_FULL and self._evict(max(size, self._bytes // 100)):
                    continue  # made room: try again
                return False
        return False

    def _write_atomic(self, path: str, header: bytes, payload: bytes, now: float) -> None:
        directory, _, name = path.rpartition("/")
        if directory not in self._made_dirs:
            make_private_dirs(Path(directory))
            self._made_dirs.add(directory)
        temp = f"{directory}/.{name.partition('.')[0]}.{os.getpid()}.{next(self._temp_ids)}{_TEMP_SUFFIX}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE)
            try:
                self._write_file(fd, (header, payload))
                if self._policy.fsync is not FsyncPolicy.NEVER:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.utime(temp, (now, now))
            os.replace(temp, path)
        except BaseException:
            self._unlink(temp)
            raise
        if self._policy.fsync is FsyncPolicy.FILE_AND_DIR:
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _evict(self, need: int) -> bool:
        """Delete least recently used files until ``need`` bytes are freed; True if any were."""
        freed = 0
        while freed < need:
            with self._lock:
                oldest = next(iter(self._index.items()), None)
            if oldest is None:
                break
            digest, entry = oldest
            freed += entry.size
            self._drop(ObjectKey(entry.kind, digest), entry, "evictions")
        return freed > 0

    def remove(self, key: ObjectKey) -> bool:
        with self._lock:
            entry = self._index.get(key.digest)
        if entry is None or entry.kind is not key.kind:
            return False
        self._drop(key, entry, None)
        return True

    def gc(self) -> None:
        now = self._clock()
        # Least recently used first: past the first entry used within the shortest
        # retention, nothing has expired.
        shortest = min(self._retention.values())
        expired = []
        with self._lock:
            for digest, entry in self._index.items():
                if now - entry.last_used <= shortest:
                    break
                if now - entry.last_used > self._retention[entry.kind]:
                    expired.append((digest, entry))
        for digest, entry in expired:
            self._drop(ObjectKey(entry.kind, digest), entry, "expirations")
        self._remove_temp_files()

    def _remove_temp_files(self) -> None:
        # Temp files are stamped by the OS, so their age is wall-clock time, not the store's clock.
        wall = time.time()
        for path in self._walk():
            name = os.path.basename(path)
            if not (name.startswith(".") and name.endswith(_TEMP_SUFFIX)):
                continue
            parts = name.split(".")  # "", hex, pid, n, "tmp"
            pid = int(parts[2]) if len(parts) == 5 and parts[2].isdigit() else None
            try:
                age = wall - os.stat(path).st_mtime
            except OSError:
                continue
            writer_gone = pid is None or (pid != os.getpid() and not _process_alive(pid))
            if writer_gone or age > self._policy.temp_grace_s:
                self._unlink(path)

    def entries(self) -> list[tuple[ObjectKey, float]]:
        with self._lock:
            return [(ObjectKey(entry.kind, digest), entry.last_used + self._retention[entry.kind])
                    for digest, entry in self._index.items()]

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._index), self._bytes

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._bytes = 0


class SizedSsdTier(SsdTier):
    """The SSD tier's policy (index, retention per kind, LRU eviction to the capacity,
    last-use times, GC) over a medium that keeps sizes only: no file is written or read,
    a hit returns a :class:`SizedPayload` of the stored size. Every decision is the
    file tier's own code; only the medium differs (the retention lab's scale mode)."""

    def _scan(self) -> None:
        pass  # no files: an empty medium

    def _delete(self, key: ObjectKey, kind: Kind) -> None:
        pass  # no file

    def sized_state(self) -> Iterator[tuple[bytes, int, int, float]]:
        """(digest, kind, size, last use) of every object, least recently used first, one
        at a time (the tier stays locked until they are all taken): the retention lab's
        checkpoints."""
        with self._lock:
            for digest, e in self._index.items():
                yield digest, int(e.kind), e.size, e.last_used

    def restore_sized(self, rows) -> None:
        """Hold ``rows`` (as :meth:`sized_state` gives them), in that order."""
        with self._lock:
            for digest, kind, size, last_used in rows:
                self._index[digest] = _Entry(Kind(kind), size, last_used, last_used)
                self._bytes += size

    def _write(self, key: ObjectKey, payload: bytes, size: int, now: float) -> bool:
        return True  # nothing to write (the size, header included, is what counts)

    def _read(self, key: ObjectKey, entry: _Entry, now: float) -> bytes | None:
        return SizedPayload(entry.size - HEADER_BYTES)

    def _remove_temp_files(self) -> None:
        pass
