"""The CPU a replica's engine thread keeps to.

A replica's engine thread steps the model back to back, but it gives way many times a
step: to the replica's event loop (each step's tokens go out as stream items), to Ray's
threads, to the router and the clients on the same host. Each time, the kernel may wake
it on another CPU, where its caches are cold. On the 2-core VM of `v41 bench serve`, 16
streams, the engine thread spent 2,318 us of CPU per token left free against 2,106 and
2,033 kept to one CPU, and the streams ran at 0.75 of the engine's own rate against 0.80
and 0.95 (docs/serving.md).

So each engine thread claims one CPU of those its process may use, highest first, that
no other engine thread of this user on this host holds, and keeps to it. A claim is an
exclusive lock on a file of its own (``cpu-N.lock``, 0600, in a 0700 folder of the
user's cache named for the host); the kernel lets go of it when the process ends, however
it ends. With every CPU claimed, or one CPU only, the thread is left free. Everything
else (event loops, Ray, the router) stays free to run anywhere.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path

from storage.slots import cache_home

log = logging.getLogger(__name__)

_held: list[int] = []  # the claims' open files: closing one would let go of its CPU


def claims_dir() -> Path:
    """Where this host's claims are: ``engine-cpus/{host}`` in the user's v41 cache
    (:func:`storage.slots.cache_home`; a home shared between hosts holds each host's own)."""
    return cache_home() / "engine-cpus" / socket.gethostname()


def claim_cpu(folder: Path | None = None) -> int | None:
    """The highest-numbered CPU this process may run on that no other claim in
    ``folder`` holds, held until the process ends; None when every one is held, the
    process may run on one CPU only, or the folder is not this user's own."""
    cpus = sorted(os.sched_getaffinity(0), reverse=True)
    if len(cpus) < 2:
        return None
    folder = folder or claims_dir()
    try:
        folder.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        for level in (folder.parent, folder):  # (parents=True would make them with the umask's mode)
            level.mkdir(mode=0o700, exist_ok=True)
        mine = folder.lstat()
    except OSError:
        return None
    if mine.st_uid != os.getuid() or mine.st_mode & 0o077:
        return None
    for cpu in cpus:
        try:
            fd = os.open(folder / f"cpu-{cpu}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        _held.append(fd)
        return cpu
    return None


def keep_to_a_cpu() -> None:
    """Keep the calling thread to a CPU it claims (:func:`claim_cpu`); left free when
    none can be claimed. (Linux: affinity 0 is the calling thread's.)"""
    cpu = claim_cpu()
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
        log.info("engine thread keeps to CPU %d", cpu)
