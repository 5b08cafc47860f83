"""The app across namespace hosts: the README's several-machines recipe, run as written.

:class:`HostsApp` takes a :class:`cluster.hosts.Hosts` and starts on it what an
operator starts on real machines: a password-protected Redis on the head's address,
``ray start --head`` on the head and ``ray start --address`` on each worker (each with
its own ``--node-ip-address``, temp folder and resources), then ``v41 serve --address``
on the head, with the environment ``v41 serve --print-env`` prints exported on every
host. Clients run inside a host (:meth:`HostsApp.client`) and call the head's address.
The fault tests and ``v41 bench ... --hosts`` drive it (`v41 bench engram --hosts`
only its raylets: :meth:`HostsApp.start_raylets`); :meth:`HostsApp.lose` kills
everything a host runs and takes its link away.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from cluster.hosts import Host, Hosts

RAY_PORT, REDIS_PORT, HTTP_PORT = 6379, 6380, 8000


def recipe_environment(port: int = HTTP_PORT) -> dict[str, str]:
    """What `v41 serve --print-env` says to export on every node before `ray start`."""
    printed = subprocess.run(["v41", "serve", "--print-env", "--port", str(port)], capture_output=True, text=True,
                             check=True).stdout
    return dict(line.removeprefix("export ").split("=", 1) for line in printed.splitlines() if line.startswith("export"))


@dataclass
class HostsApp:
    """The app on ``cluster``'s hosts. ``config``: the app's YAML settings (the model,
    the pools' resources...); ``head_resources`` and ``worker_resources`` (one per
    worker): each raylet's custom resources; ``cpus``: each raylet's CPUs."""

    cluster: Hosts
    config: str
    head_resources: dict = field(default_factory=lambda: {"prefill_host": 1})
    worker_resources: list[dict] = field(default_factory=list)
    cpus: int = 2
    keys: str | None = None
    env: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        # (Ray in a namespace host: token auth would need the token file on every host.)
        self.env = {**os.environ, **recipe_environment(), "RAY_AUTH_MODE": "disabled"}
        self.password = os.urandom(16).hex()
        self.serve: subprocess.Popen | None = None

    @property
    def head(self) -> Host:
        return self.cluster.head

    @property
    def url(self) -> str:
        return f"http://{self.head.address}:{HTTP_PORT}"

    @property
    def log(self) -> str:
        path = self.head.folder / "serve.log"
        return path.read_text() if path.exists() else ""

    def run(self, host: Host, command: list[str], timeout: float = 180, check: bool = True):
        return subprocess.run(host.argv(command), capture_output=True, text=True, timeout=timeout, env=self.env,
                              check=check)

    def start(self, timeout_s: float = 300) -> HostsApp:
        """Redis, the raylets, `v41 serve`; returns once the app answers a request."""
        head, folder = self.head, self.head.folder
        (folder / "redis.pw").write_text(self.password + "\n")
        self.cluster.start(head, ["redis-server", "--bind", head.address, "--port", str(REDIS_PORT), "--requirepass",
                                  self.password, "--save", "", "--appendonly", "no", "--dir", str(folder)],
                           stdout=subprocess.DEVNULL)
        self.start_raylets()
        (folder / "app.yaml").write_text(self.config.replace("{run}", str(self.cluster.folder)))
        access = ["--insecure-no-auth"]
        if self.keys is not None:
            (folder / "keys.yaml").write_text(self.keys)
            access = ["--api-keys", str(folder / "keys.yaml")]
        self.serve = self.cluster.start(
            head, ["v41", "serve", "--address", f"{head.address}:{RAY_PORT}", "--redis-url",
                   f"redis://{head.address}:{REDIS_PORT}/0", "--redis-password-file", str(folder / "redis.pw"),
                   "--config", str(folder / "app.yaml"), "--host", "0.0.0.0", "--port", str(HTTP_PORT), *access],
            stdout=(folder / "serve.log").open("w"), stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout_s
        while "v41 serving" not in self.log:
            if self.serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"v41 serve did not start:\n{self.log[-3000:]}")
            time.sleep(1)
        while self.health(self.head)[0] != 200:  # (the replicas start after the serving line)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the app did not become healthy:\n{self.log[-3000:]}")
            time.sleep(1)
        return self

    def start_raylets(self) -> None:
        """`ray start --head` on the head and `ray start --address` on every worker (all
        :meth:`start` needs of Ray; a bench without the app runs just this)."""
        head = self.head
        self.run(head, ["ray", "start", "--head", f"--node-ip-address={head.address}", f"--port={RAY_PORT}",
                        f"--temp-dir={head.folder}/ray", f"--num-cpus={self.cpus}", "--disable-usage-stats",
                        "--include-dashboard=false", "--resources", json.dumps(self.head_resources)])
        for worker in self.cluster.workers:
            self.join(worker)

    def join(self, worker: Host) -> None:
        """`ray start --address` on ``worker``."""
        resources = self.worker_resources[worker.index - 1] if worker.index <= len(self.worker_resources) else {}
        self.run(worker, ["ray", "start", f"--address={self.head.address}:{RAY_PORT}",
                          f"--node-ip-address={worker.address}", f"--temp-dir={worker.folder}/ray",
                          f"--num-cpus={self.cpus}", "--disable-usage-stats", "--resources", json.dumps(resources)])

    def lose(self, host: Host) -> None:
        """Host loss: the link goes first (nothing it says gets out), then every process
        in the host is killed."""
        self.cluster.cut(host)
        self.cluster.kill(host)

    def client(self, host: Host, code: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        """Python ``code`` run inside ``host`` with the app's URL as ``sys.argv[1]``."""
        return subprocess.run(host.argv([sys.executable, "-c", code, self.url, *args]), capture_output=True,
                              text=True, env=self.env, timeout=timeout)

    def health(self, host: Host) -> tuple[int, dict]:
        """(status, body) of ``/health`` asked from ``host`` (0 and the error when unreachable)."""
        done = self.client(host, _HEALTH, timeout=30)
        try:
            return tuple(json.loads(done.stdout.strip().splitlines()[-1]))
        except (IndexError, ValueError):
            return 0, {"error": done.stderr[-500:]}

    def stop(self) -> None:
        if self.serve is not None and self.serve.poll() is None:
            self.serve.send_signal(2)
            try:
                self.serve.wait(60)
            except subprocess.TimeoutExpired:
                self.serve.kill()


_HEALTH = """
import json, sys, urllib.error, urllib.request
try:
    answer = urllib.request.urlopen(sys.argv[1] + "/health", timeout=10)
    print(json.dumps([answer.status, json.loads(answer.read())]))
except urllib.error.HTTPError as error:
    print(json.dumps([error.code, json.loads(error.read() or b"{}")]))
except OSError as error:
    print(json.dumps([0, {"error": str(error)}]))
"""
