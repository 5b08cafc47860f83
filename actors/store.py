"""The store actor: one :class:`storage.store.TieredStore` per node, shared by its replicas.

Pools on a node reach their node's store through :func:`node_store`, which gets or
creates the detached actor ``v41-store-<node id>`` pinned to that node and hands it
the app's current :class:`StoreSettings` (a redeploy that changes them reopens the
store with the new ones). The actor is a thin shell: every method forwards to the
TieredStore.

The store is a cache, so it is never a reason for a request to fail: a call that
does not answer reads as a miss. Ray restarts a killed store actor (``max_restarts``);
it reopens its SSD slot (:mod:`storage.slots`), whose files and index entries it
republishes, and the clients' handles keep working. A client that saw a failure
hands the actor its settings again (a restarted actor starts from the settings it
was created with), and one whose actor is gone for good gets a new one.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from storage.keys import Fingerprint, ObjectKey
from storage.policy import RetentionPolicy
from storage.private import read_secret
from storage.slots import Slot, claim
from storage.store import StoreConfig, TieredStore

NODE_NAME_ENV = "V41_NODE_NAME"  # set on a machine (before `ray start`) to name its SSD slot
STORE_TIMEOUT_S = 5.0  # a store read that takes longer is a miss (the actor is restarting or hung)
STORE_RETRY_S = 2.0  # after a failed read, a client's reads miss at once for this long


@dataclass(frozen=True)
class StoreSettings:
    """How every node's store is configured (all retention numbers are config)."""

    ssd_dir: str | None = None  # "{node}": this machine's slot under that directory (storage.slots)
    redis_url: str | None = None
    redis_stores_bytes: bool = False
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    # The cluster's secret, which keys every stored object's MAC: a file each node reads
    # (None: the MAC is keyed by the model's fingerprint, a checksum against accidents).
    secret_file: str | None = None

    def open(self, node_id: str, fingerprint: Fingerprint) -> tuple[TieredStore, Slot | None]:
        """The node's store, on the SSD slot this process claims for it."""
        secret = None
        if self.secret_file is not None:
            try:
                secret = read_secret(Path(self.secret_file))
            except OSError as error:
                raise ValueError(f"node {node_id}: cannot read cache_secret_file {self.secret_file} "
                                 f"({error.strerror}); every node needs a copy of it (0600)") from None
        slot = None
        if self.ssd_dir is not None:
            slot = claim(self.ssd_dir, os.environ.get(NODE_NAME_ENV) or None,
                         collect_after_s=self.retention.longest_retention_s)
        config = StoreConfig(node_id=node_id, ssd_dir=slot.path if slot else None, redis_url=self.redis_url,
                             redis_stores_bytes=self.redis_stores_bytes, retention=self.retention)
        try:
            return TieredStore(config, fingerprint, secret=secret), slot
        except BaseException:
            if slot is not None:
                slot.release()
            raise


class StoreActor:
    """A node's tiered store, as a Ray actor."""

    def __init__(self, settings: StoreSettings, fingerprint: bytes, node_id: str, metrics_interval_s: float = 10.0):
        from actors.metrics import StoreMetrics

        self._node_id = node_id
        self._lock = threading.Lock()
        self.settings: StoreSettings | None = None
        self.fingerprint = b""
        self._slot: Slot | None = None
        self.store: TieredStore | None = None
        self.configure(settings, fingerprint)
        self._metrics = StoreMetrics()
        self._stop = threading.Event()

        def export() -> None:  # hits, misses and bytes per tier, for Prometheus; the slot is alive
            while not self._stop.wait(metrics_interval_s):
                self._metrics.export(self.store.stats())
                if self._slot is not None:
                    self._slot.touch()

        threading.Thread(target=export, name="store-metrics", daemon=True).start()

    def configure(self, settings: StoreSettings, fingerprint: bytes) -> bool:
        """Use ``settings`` from now on; True if that reopened the store (queued writes
        of the old one land first, in its own directory)."""
        with self._lock:
            if settings == self.settings and fingerprint == self.fingerprint:
                return False
            old, old_slot = self.store, self._slot
            if old is not None:
                old.close()
            if old_slot is not None:
                old_slot.release()
            self.store, self._slot = settings.open(self._node_id, Fingerprint(fingerprint))
            self.settings, self.fingerprint = settings, fingerprint
            return True

    def get_many(self, keys: list[ObjectKey]) -> list[bytes | None]:
        return self.store.get_many(keys)

    def put(self, key: ObjectKey, payload: bytes) -> None:
        self.store.put(key, payload)

    def put_indexed(self, objects: list[tuple[ObjectKey, bytes]]) -> bool:
        """Store ``objects`` and send their index entries now (not on the publisher's
        next beat); True once Redis has them (False without Redis, or with it away)."""
        for key, payload in objects:
            self.store.put(key, payload)
        return self.store.publish()

    def remove(self, key: ObjectKey, timeout: float = 10.0) -> None:
        """Delete ``key`` from every tier, after the writes queued before it (which
        would otherwise land after the delete)."""
        self.remove_many([key], timeout)

    def remove_many(self, keys: list[ObjectKey], timeout: float = 10.0) -> None:
        """:meth:`remove` of each key, after one flush."""
        self.store.flush(timeout)
        for key in keys:
            self.store.remove(key)

    def flush(self, timeout: float = 10.0) -> bool:
        return self.store.flush(timeout)

    def stats(self):
        return self.store.stats()

    def ssd_dir(self) -> str | None:
        """The SSD slot this store uses (None without an SSD tier)."""
        return str(self._slot.path) if self._slot is not None else None

    def pid(self) -> int:
        return os.getpid()


_ACTOR_OPTIONS = {
    "lifetime": "detached",
    "num_cpus": 0,
    "max_concurrency": 8,
    "max_restarts": -1,  # a crashed store comes back on its SSD slot
    "max_task_retries": 0,  # a call cut short reads as a miss; it is not replayed
}


def _store_actor(settings: StoreSettings, fingerprint: bytes, node_id: str, namespace: str):
    return ray.remote(StoreActor).options(
        name=f"{namespace}-store-{node_id}",
        namespace=namespace,
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        **_ACTOR_OPTIONS,
    ).remote(settings, fingerprint, node_id)


class RemoteStore:
    """The :class:`actors.prefill.StoreLike` face of a store actor (blocking calls).

    A read of an actor that Ray is restarting waits for it (the restarted store reads its
    SSD slot, and the turns sent in that second should find their cache there). A read
    that fails otherwise, or gets no answer within ``timeout_s`` (hung, or still not back),
    is a miss for every key, and so is every read for ``STORE_RETRY_S`` after it (one wait
    per request, not one per read); a failed write is dropped. With ``settings``, a failure also
    re-sends them, or replaces an actor that is gone for good.
    """

    def __init__(self, handle, settings: StoreSettings | None = None, fingerprint: bytes = b"",
                 node_id: str = "", namespace: str = "v41", timeout_s: float = STORE_TIMEOUT_S):
        self.handle = handle
        self._settings, self._fingerprint, self._node_id = settings, fingerprint, node_id
        self._namespace, self._timeout_s = namespace, timeout_s
        self._down_until = 0.0  # time.monotonic(): after a failure, reads miss at once until then

    def get_many(self, keys: list[ObjectKey]) -> list[bytes | None]:
        if time.monotonic() < self._down_until:
            return [None] * len(keys)
        deadline = time.monotonic() + self._timeout_s
        pause = 0.05
        while True:
            try:
                return ray.get(self.handle.get_many.remote(keys), timeout=max(0.0, deadline - time.monotonic()))
            except ActorUnavailableError:
                # Restarting (Ray brings it back on its SSD slot in about a second): a
                # read is safe to repeat, and waiting for the SSD beats encoding again.
                if time.monotonic() + pause < deadline:
                    time.sleep(pause)
                    pause = min(2 * pause, 0.5)
                    continue
            except (RayError, GetTimeoutError):
                pass
            self._down_until = time.monotonic() + STORE_RETRY_S
            self.recover()
            return [None] * len(keys)

    def put(self, key: ObjectKey, payload: bytes) -> None:
        self.handle.put.remote(key, payload)  # fire and forget: the store writes behind anyway

    async def put_now(self, objects: list[tuple[ObjectKey, bytes]]) -> bool:
        """Store ``objects`` in the node's RAM tier and index them, and wait for it (up
        to the read timeout); False if the store or Redis did not take them in time."""
        try:
            ref = self.handle.put_indexed.remote(objects)
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self._timeout_s)
        except (RayError, TimeoutError):
            self.recover()
            return False

    def remove(self, key: ObjectKey) -> bool:
        """Delete ``key`` from the node's tiers and the index, and wait for it; False if
        the store did not answer in time."""
        return self.remove_many([key])

    def remove_many(self, keys: list[ObjectKey]) -> bool:
        """:meth:`remove` of each key, in one call."""
        try:
            ray.get(self.handle.remove_many.remote(keys), timeout=2 * self._timeout_s)
            return True
        except (RayError, GetTimeoutError):
            self.recover()
            return False

    def recover(self) -> None:
        """After a failed call: get the node's store actor again (the same one once Ray
        has restarted it, a new one if it is gone) and give it the current settings."""
        if self._settings is None:
            return
        try:
            self.handle = _store_actor(self._settings, self._fingerprint, self._node_id, self._namespace)
            self.handle.configure.remote(self._settings, self._fingerprint)
        except RayError:
            pass  # the next failure tries again


def store_actors(namespace: str = "v41") -> dict:
    """The store actor of every live node that has one, by node id."""
    handles = {}
    for node in ray.nodes():
        if node.get("Alive"):
            try:
                handles[node["NodeID"]] = ray.get_actor(f"{namespace}-store-{node['NodeID']}", namespace=namespace)
            except ValueError:  # a node without a store
                continue
    return handles


def tier_totals(namespace: str = "v41") -> dict[str, dict[str, int]]:
    """Every counter of every tier (hits, misses, puts, evictions...), summed over the
    store actors of all live nodes. A restarted store counts from zero."""
    from dataclasses import asdict

    totals: dict[str, dict[str, int]] = {}
    for store in store_actors(namespace).values():
        for tier, counters in ray.get(store.stats.remote()).tiers.items():
            row = totals.setdefault(tier, {})
            for key, value in asdict(counters).items():
                row[key] = row.get(key, 0) + value
    return totals


def peer_store(node_id: str, namespace: str = "v41") -> RemoteStore | None:
    """The store actor of another node (None if that node has none): reading from it
    moves the bytes node to node, through Ray's object transfer."""
    try:
        return RemoteStore(ray.get_actor(f"{namespace}-store-{node_id}", namespace=namespace))
    except ValueError:
        return None


def node_store(settings: StoreSettings, fingerprint: bytes, namespace: str = "v41") -> RemoteStore:
    """The store actor of the node this process runs on (created on first use), set
    to ``settings`` (the actor reopens its store if they changed)."""
    node_id = ray.get_runtime_context().get_node_id()
    actor = _store_actor(settings, fingerprint, node_id, namespace)
    ray.get(actor.configure.remote(settings, fingerprint))
    return RemoteStore(actor, settings, fingerprint, node_id, namespace)
