"""Hosts on one machine: Linux network namespaces with their own addresses and shaped links.

A multi-node test or bench needs nodes that are different hosts: each with its own
address (no part may bind to 127.0.0.1 where another node must reach it), its own
loopback, and a link whose bandwidth is that of a network, not of memory. On one
machine, as root, :class:`Hosts` makes them:

- a *switch* namespace holding a bridge, and one namespace per host (``h0`` the head,
  ``w1``..``wN`` the workers), each joined to the bridge by a veth pair: ``eth0`` in the
  host, ``pI`` on the switch;
- addresses from a private range on that bridge only (``10.241.R.I/24``, ``R`` a run's
  number), no route anywhere else: nothing is sent off the machine;
- each link shaped with ``tc ... tbf`` in both directions (the host's ``eth0`` egress,
  the switch port's egress toward it), ``link_gbit`` each way; :meth:`Hosts.shape`
  changes it, :meth:`Hosts.cut` and :meth:`Hosts.heal` partition a host and bring it
  back.

Everything it makes is named ``v41h-R-...``: :func:`clean` kills every process inside
such namespaces and deletes them (their veth pairs go with them) and the run folders
under :data:`RUNS`, so a run killed half-way is cleaned by the next one (or by hand:
``python -m cluster.hosts clean``). Nothing else on the machine is touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PREFIX = "v41h-"
RUNS = Path(tempfile.gettempdir()) / "v41-hosts"  # each run's folders: RUNS/v41h-R (0700, root's own)
MARK = ".v41-hosts-run"  # the file that says a run folder is the harness's


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or no iproute2)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> str | None:
    """Why hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return None


def namespaces() -> list[str]:
    """The harness's namespaces on this machine now (its runs', live or left over)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    return sorted(line.split()[0] for line in listed if line.startswith(PREFIX))


def kill_all(namespace: str) -> None:
    """SIGKILL every process inside ``namespace``."""
    for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def clean(run: str | None = None) -> list[str]:
    """Kill every process in the harness's namespaces (``run``'s only, or every run's),
    delete them and their runs' folders; returns the namespaces deleted."""
    wanted = [ns for ns in namespaces() if run is None or ns.startswith(f"{run}-")]
    for ns in wanted:
        kill_all(ns)
    for ns in wanted:
        _ip("netns", "del", ns, check=False)
    if RUNS.is_dir():
        for folder in RUNS.iterdir():
            if folder.name.startswith(PREFIX) and (run is None or folder.name == run) and (folder / MARK).exists():
                shutil.rmtree(folder, ignore_errors=True)
    return wanted


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its address on the bridge, its index (0: the head)."""

    name: str
    namespace: str
    address: str
    index: int
    folder: Path  # its own disk: SSD slots, logs

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run inside this host."""
        return ["ip", "netns", "exec", self.namespace, *command]


class Hosts:
    """A head and ``workers`` hosts joined by a switch (see the module docstring).
    ``run``: the run's number (1-250), which names everything it makes."""

    def __init__(self, workers: int, link_gbit: float = 1.0, run: int | None = None) -> None:
        problem = available()
        if problem is not None:
            raise HostsUnavailable(problem)
        if not 1 <= workers <= 200:
            raise ValueError("1 to 200 workers")
        self.run_number = run if run is not None else 1 + os.getpid() % 250
        self.run = f"{PREFIX}{self.run_number}"
        self.link_gbit = link_gbit
        self.switch = f"{self.run}-sw"
        self.folder = RUNS / self.run
        self.hosts = [Host("h0" if i == 0 else f"w{i}", f"{self.run}-{'h0' if i == 0 else f'w{i}'}",
                           f"10.241.{self.run_number}.{i + 1}", i, self.folder / ("h0" if i == 0 else f"w{i}"))
                      for i in range(workers + 1)]
        self._processes: list[subprocess.Popen] = []

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def workers(self) -> list[Host]:
        return self.hosts[1:]

    def __enter__(self) -> Hosts:
        clean(self.run)  # (what a killed run of the same number left)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _make(self) -> None:
        from storage.private import make_private_dirs
        from storage.slots import check_private

        make_private_dirs(RUNS)
        check_private(RUNS)  # (a shared temp folder: one another user made first is refused)
        self.folder.mkdir(mode=0o700)
        (self.folder / MARK).write_text("made by cluster.hosts; deleted by its clean()\n")
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            host.folder.mkdir(mode=0o700)
            port = f"p{host.index}"
            _ip("netns", "add", host.namespace)
            _ip("link", "add", "name", "eth0", "netns", host.namespace, "type", "veth",
                "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            self.shape(host, self.link_gbit)

    def shape(self, host: Host, gbit: float) -> None:
        """The host's link: ``gbit`` each way (tbf on both ends of its veth pair)."""
        rate = f"{max(1, round(gbit * 1000))}mbit"
        burst = f"{max(32, round(gbit * 1000 * 1000 / 8 / 250))}kb"  # ~4 ms of traffic
        for namespace, device in ((host.namespace, "eth0"), (self.switch, f"p{host.index}")):
            subprocess.run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
                            "burst", burst, "latency", "50ms"], check=True, capture_output=True)

    def cut(self, host: Host) -> None:
        """Partition ``host``: its switch port goes down (its processes keep running)."""
        _ip("-n", self.switch, "link", "set", f"p{host.index}", "down")

    def heal(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", f"p{host.index}", "up")

    def kill(self, host: Host) -> None:
        """Kill every process running inside ``host`` (its namespace stays)."""
        kill_all(host.namespace)

    def start(self, host: Host, command: list[str], **popen) -> subprocess.Popen:
        """Start ``command`` inside ``host`` (killed by :meth:`close` with the rest)."""
        process = subprocess.Popen(host.argv(command), **popen)
        self._processes.append(process)
        return process

    def close(self) -> None:
        """Kill what runs in the hosts and delete them, their links and folders."""
        for process in self._processes:
            if process.poll() is None:
                process.kill()
        for process in self._processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        clean(self.run)


if __name__ == "__main__":
    if sys.argv[1:] == ["clean"]:
        print("deleted:", " ".join(clean()) or "nothing")
    else:
        print("usage: python -m cluster.hosts clean", file=sys.stderr)
        sys.exit(2)
