"""The hosts harness (cluster/hosts.py): namespaces with their own addresses joined by a
switch, links shaped with tbf, partitions, and nothing left behind, even by a run that
was killed half-way."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from cluster import hosts
from cluster.hosts import Hosts

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(hosts.available() is not None, reason=str(hosts.available()))]

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 9000)); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    n = 0
    while chunk := c.recv(1 << 16):
        n += len(chunk)
    c.sendall(str(n).encode()); c.close()
"""
CLIENT = """
import socket, sys, time
started = time.perf_counter()
s = socket.create_connection((sys.argv[1], 9000), timeout=float(sys.argv[3]))
s.sendall(bytes(int(sys.argv[2]))); s.shutdown(socket.SHUT_WR)
print(s.recv(100).decode(), time.perf_counter() - started)
"""


def _send(hosts_: Hosts, source, target: str, size: int, timeout: float = 10.0) -> tuple[int, float] | None:
    """Send ``size`` bytes from ``source`` to ``target``:9000; (bytes received, seconds), or None."""
    done = subprocess.run(source.argv([sys.executable, "-c", CLIENT, target, str(size), str(timeout)]),
                          capture_output=True, text=True, timeout=timeout + 30)
    if done.returncode:
        return None
    received, seconds = done.stdout.split()
    return int(received), float(seconds)


def test_hosts_reach_each_other_by_address_over_a_shaped_link_and_can_be_cut_off():
    with Hosts(2, link_gbit=0.1, run=241) as cluster:
        head, worker, other = cluster.hosts
        assert len({h.address for h in cluster.hosts}) == 3 and all(h.address.startswith("10.241.241.")
                                                                   for h in cluster.hosts)
        server = cluster.start(worker, [sys.executable, "-c", SERVER, worker.address], stdout=subprocess.PIPE,
                               text=True)
        assert server.stdout.readline().strip() == "listening"
        # Each host's loopback is its own: the worker's server is not on the head's 127.0.0.1.
        assert _send(cluster, head, "127.0.0.1", 10, timeout=2) is None
        assert _send(cluster, head, worker.address, 10)[0] == 10  # by its address, across the switch
        size = 2_500_000  # 20 Mbit: at least 0.2 s through a 100 Mbit/s link
        received, seconds = _send(cluster, other, worker.address, size)
        assert received == size and seconds >= 0.8 * size * 8 / 100e6  # no faster than the link allows
        cluster.shape(worker, 1.0)
        assert _send(cluster, other, worker.address, size)[0] == size
        cluster.cut(worker)
        assert _send(cluster, head, worker.address, 10, timeout=2) is None
        cluster.heal(worker)
        assert _send(cluster, head, worker.address, 10)[0] == 10
    assert _of_run(241) == [] and not (hosts.RUNS / "v41h-241").exists()


def test_a_run_killed_half_way_is_cleaned_by_the_next(tmp_path):
    """A process that made hosts and started a process in one is SIGKILLed: its
    namespaces, their processes and its folders stay; the next run's cleanup (by their
    names) leaves none of them."""
    script = textwrap.dedent("""
        import sys, time
        from cluster.hosts import Hosts
        cluster = Hosts(1, run=242).__enter__()
        cluster.start(cluster.workers[0], [sys.executable, "-c", "import time; time.sleep(3600)"])
        print("up", flush=True)
        time.sleep(3600)
    """)
    maker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert maker.stdout.readline().strip() == "up"
    finally:
        maker.kill()
        maker.wait()
    left = _of_run(242)
    assert left == ["v41h-242-h0", "v41h-242-sw", "v41h-242-w1"]
    sleeper = _pids_in("v41h-242-w1")
    assert len(sleeper) == 1 and (hosts.RUNS / "v41h-242").is_dir()
    with Hosts(1, run=242):  # the next run of that number cleans first
        assert _of_run(242) == left
    assert _of_run(242) == [] and not (hosts.RUNS / "v41h-242").exists()
    assert not _running(int(sleeper[0]))  # killed (at most a zombie its new parent has not reaped yet)


def _pids_in(namespace: str, wait_s: float = 10.0) -> list[str]:
    """The processes in ``namespace``, once there is one: ``ip netns exec`` enters it a
    moment after it was started (longer on a loaded machine)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
        if pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def _of_run(run: int) -> list[str]:
    """The namespaces of one run (tests in other processes may hold runs of their own)."""
    return [name for name in hosts.namespaces() if name.startswith(f"v41h-{run}-")]


def _running(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
