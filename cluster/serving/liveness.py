"""Which hosts are lost or cut off, known in seconds: the router stops reading from them
and ends the answers they were streaming.

Ray declares a node dead only after its health checks have failed for tens of seconds
(and `v41 serve --print-env` raises that bound, so that a short partition does not
kill a node's actors: :func:`cluster.serving.local.cluster_environment`). Until then a
request planned onto a lost host's cache waits on it, and an answer it was streaming
hangs. :class:`NodeLiveness` asks each node's raylet for a TCP connection every
``period_s``: the kernel answers it however busy the node's processes are, so a slow
store is not a lost host, while a host whose link is gone (or whose processes are all
dead) fails it within ``timeout_s``. After ``misses`` failures in a row the node is
*down*:

- the planner ignores the copies the Redis index lists on it (:meth:`usable`), so a
  returning turn recomputes what only that host held instead of waiting on it, and the
  decoder replicas on it are not chosen (:meth:`live_replicas`);
- every answer streaming from a decoder replica on it ends at once with an error
  (:meth:`watch`: a 503 before the first token, an error event after it);
- ``/health`` says so (degraded).

The first answer it gives again brings the node back: its stored copies (an SSD tier
kept across the partition) are read again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class NodeAddress:
    """A node Ray knows, and the address of its raylet."""

    node_id: str
    host: str
    port: int
    alive: bool  # as Ray's control store says (it lags a lost host by tens of seconds)


def ray_nodes() -> list[NodeAddress]:
    import ray

    return [NodeAddress(n["NodeID"], n["NodeManagerAddress"], int(n["NodeManagerPort"]), bool(n["Alive"]))
            for n in ray.nodes()]


async def answers(node: NodeAddress, timeout_s: float) -> bool:
    """Does the node's raylet accept a TCP connection within ``timeout_s``?"""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(node.host, node.port), timeout_s)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


class NodeLiveness:
    """The down nodes, as this router sees them (see the module docstring). ``nodes``:
    the cluster's nodes (asked again every ``refresh_s``); ``probe``: one node's check."""

    def __init__(self, nodes: Callable[[], list[NodeAddress]] = ray_nodes,
                 probe: Callable[[NodeAddress, float], Awaitable[bool]] = answers, period_s: float = 1.0,
                 timeout_s: float = 1.0, misses: int = 2, refresh_s: float = 5.0) -> None:
        self.nodes, self.probe = nodes, probe
        self.period_s, self.timeout_s, self.misses, self.refresh_s = period_s, timeout_s, misses, refresh_s
        self.down: dict[str, float] = {}  # node id -> since when (time.monotonic): not answering
        self.dead: set[str] = set()  # nodes Ray has declared dead (they never come back: a rejoined host is a new node)
        # Told of the nodes found dead in a round, once each (the index drops their copies).
        self.on_dead: Callable[[list[str]], None] | None = None
        self._failed: dict[str, int] = {}
        self._streams: dict[str, weakref.WeakSet] = {}
        self._known: list[NodeAddress] = []
        self._listed = float("-inf")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Check in the background on the running loop (once; called per request)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # noqa: BLE001 (a control store that does not answer: ask again)
                logger.exception("checking the nodes failed")
            await asyncio.sleep(self.period_s)

    async def check(self) -> None:
        """One round: every node Ray lists as alive asked at once; those Ray lists as
        dead are down."""
        now = time.monotonic()
        if now - self._listed >= self.refresh_s:
            self._known = await asyncio.to_thread(self.nodes)
            self._listed = now
        alive = [node for node in self._known if node.alive]
        asked = time.monotonic()
        results = await asyncio.gather(*(self.probe(node, self.timeout_s) for node in alive))
        # A round that took well past the timeout means this event loop was held up (a
        # busy router), not that the hosts were: its failures are not counted.
        late = time.monotonic() - asked > 1.5 * self.timeout_s
        for node, ok in zip(alive, results):
            if not ok and late:
                continue
            self._failed[node.node_id] = 0 if ok else self._failed.get(node.node_id, 0) + 1
            if ok and self.down.pop(node.node_id, None) is not None:
                logger.warning("node %s answers again: its stored caches are read again", node.node_id[:12])
            elif self._failed[node.node_id] >= self.misses and node.node_id not in self.down:
                self.down[node.node_id] = time.monotonic()
                logger.warning("node %s (host %s) is not answering: its caches are not read, its streams end",
                               node.node_id[:12], node.host)
                self._end_streams(node.node_id)
        newly_dead = [node.node_id for node in self._known if not node.alive and node.node_id not in self.dead]
        for node_id in newly_dead:
            self.dead.add(node_id)
            self.down.pop(node_id, None)
            self._end_streams(node_id)
        if newly_dead and self.on_dead is not None:
            await asyncio.to_thread(self.on_dead, newly_dead)

    def excluded(self, node_id: str) -> bool:
        return node_id in self.down or node_id in self.dead

    def _end_streams(self, node_id: str) -> None:
        for stream in list(self._streams.pop(node_id, ())):
            stream.lose(f"the host of the decoder replica (node {node_id[:12]}) was lost")

    def watch(self, node_id: str | None, stream) -> None:
        """``stream`` (a :class:`actors.events.TokenStream`) comes from a replica on
        ``node_id``: it ends with :class:`actors.events.HostLost` if that node goes down."""
        if node_id is None:
            return
        if self.excluded(node_id):
            stream.lose(f"the host of the decoder replica (node {node_id[:12]}) is down")
            return
        self._streams.setdefault(node_id, weakref.WeakSet()).add(stream)

    def usable(self, located: list[tuple]) -> list[tuple]:
        """The index's copies of each object (``Location`` tuples) without those on down nodes."""
        if not (self.down or self.dead):
            return located
        return [tuple(loc for loc in locations if not self.excluded(loc.node_id)) for locations in located]

    def live_replicas(self, replicas: dict[str, str]) -> dict[str, str]:
        """{replica: node} without the replicas on down nodes."""
        if not (self.down or self.dead):
            return replicas
        return {replica: node for replica, node in replicas.items() if not self.excluded(node)}

    def problems(self) -> list[str]:
        """``/health`` lines: one per node not answering (a dead one is Serve's pools' to report)."""
        now = time.monotonic()
        return [f"node {node_id[:12]}: host not answering for {now - since:.0f} s; its caches are not read"
                for node_id, since in self.down.items()]
