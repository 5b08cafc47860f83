"""Folders and files only their owner may read: 0700 and 0600, whatever the umask.

What the store and the embedded Redis write (cached conversations, a password, a slot's
marker) is made with these modes from creation on, never widened and then narrowed.
:func:`why_not_private` tells whether only the user (and root) can change what a folder
holds, which decides how the SSD tier checks its files (storage/ssd_tier.py).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents, each 0700 (``os.makedirs`` gives the
    parents the umask's mode, often 0755)."""
    missing: list[Path] = []
    current = Path(directory)
    while not os.path.lexists(current) and current != current.parent:
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, PRIVATE_DIR)
        except FileExistsError:
            pass  # made meanwhile (another store): checked by whoever uses it


def why_not_private(directory: Path) -> str | None:
    """None if no one but this process's user and root can change what ``directory``
    holds (the real folder, links resolved): it is the user's own and 0700, and every
    folder above it is root's or the user's and writable by no one else, unless sticky
    as /tmp is (its other users can then neither rename nor remove the user's entries).
    Else the first reason it is not, naming the folder."""
    uid = os.geteuid()
    path = os.path.realpath(directory)
    info = os.stat(path)
    if info.st_uid != uid:
        return f"{path} belongs to uid {info.st_uid}, not {uid}"
    if info.st_mode & 0o077:
        return f"{path} has mode {stat.S_IMODE(info.st_mode):04o}, not 0700"
    while path != (parent := os.path.dirname(path)):
        path = parent
        info = os.stat(path)
        if info.st_uid not in (0, uid):
            return f"{path} belongs to uid {info.st_uid}"
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: others can write it"
    return None


def write_private(path: Path, data: bytes) -> None:
    """``data`` as the file ``path``, 0600, whole or not at all: written to a temp file
    beside it (never following a link planted there), fsynced, renamed over ``path``."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)  # (a temp file left by a dead process may have had another mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)


SECRET_BYTES = 32
MIN_SECRET_BYTES = 16


def read_secret(path: Path) -> bytes:
    """A secret kept in a file (its bytes, surrounding whitespace stripped): at least
    ``MIN_SECRET_BYTES``, else a ValueError naming the file."""
    secret = Path(path).read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path} holds {len(secret)} bytes; a secret needs at least {MIN_SECRET_BYTES}")
    return secret


def own_secret(path: Path) -> bytes:
    """The secret in ``path``, made there first if there is none: ``SECRET_BYTES``
    random bytes written as hex digits (text that :func:`read_secret` reads back
    unchanged: raw bytes that began or ended in a whitespace byte were stripped by every
    later reader, so the maker and its readers keyed with different secrets), 0600, its
    missing folders 0700; never replaced (the first of two processes that make it at
    once wins, and both read its bytes)."""
    make_private_dirs(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
    except FileExistsError:
        return read_secret(path)
    try:
        secret = secrets.token_hex(SECRET_BYTES).encode()
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    return secret
