"""The store actor: one :class:`storage.store.TieredStore` per node, shared by its replicas.

Pools on a node reach their node's store through :func:`node_store`, which gets or
creates the detached actor ``v41-store-<node id>`` pinned to that node. The actor is
a thin shell: every method forwards to the TieredStore.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from storage.keys import Fingerprint, ObjectKey
from storage.policy import RetentionPolicy
from storage.store import StoreConfig, TieredStore


@dataclass(frozen=True)
class StoreSettings:
    """How every node's store is configured (all retention numbers are config)."""

    ssd_dir: str | None = None  # per node; "{node}" is replaced by the node id
    redis_url: str | None = None
    redis_stores_bytes: bool = False
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)

    def for_node(self, node_id: str) -> StoreConfig:
        ssd = Path(self.ssd_dir.replace("{node}", node_id[:12])) if self.ssd_dir else None
        return StoreConfig(node_id=node_id, ssd_dir=ssd, redis_url=self.redis_url,
                           redis_stores_bytes=self.redis_stores_bytes, retention=self.retention)


class StoreActor:
    """A node's tiered store, as a Ray actor."""

    def __init__(self, settings: StoreSettings, fingerprint: bytes, node_id: str, metrics_interval_s: float = 10.0):
        import threading

        from cluster.metrics import StoreMetrics

        self.store = TieredStore(settings.for_node(node_id), Fingerprint(fingerprint))
        self._metrics = StoreMetrics()
        self._stop = threading.Event()

        def export() -> None:  # hits, misses and bytes per tier, for Prometheus
            while not self._stop.wait(metrics_interval_s):
                self._metrics.export(self.store.stats())

        threading.Thread(target=export, name="store-metrics", daemon=True).start()

    def get_many(self, keys: list[ObjectKey]) -> list[bytes | None]:
        return self.store.get_many(keys)

    def put(self, key: ObjectKey, payload: bytes) -> None:
        self.store.put(key, payload)

    def remove(self, key: ObjectKey) -> None:
        self.store.remove(key)

    def flush(self, timeout: float = 10.0) -> bool:
        return self.store.flush(timeout)

    def stats(self):
        return self.store.stats()


class RemoteStore:
    """The :class:`actors.prefill.StoreLike` face of a store actor (blocking calls)."""

    def __init__(self, handle):
        self.handle = handle

    def get_many(self, keys: list[ObjectKey]) -> list[bytes | None]:
        return ray.get(self.handle.get_many.remote(keys))

    def put(self, key: ObjectKey, payload: bytes) -> None:
        self.handle.put.remote(key, payload)  # fire and forget: the store writes behind anyway


def peer_store(node_id: str, namespace: str = "v41") -> RemoteStore | None:
    """The store actor of another node (None if that node has none): reading from it
    moves the bytes node to node, through Ray's object transfer."""
    try:
        return RemoteStore(ray.get_actor(f"{namespace}-store-{node_id}", namespace=namespace))
    except ValueError:
        return None


def node_store(settings: StoreSettings, fingerprint: bytes, namespace: str = "v41") -> RemoteStore:
    """The store actor of the node this process runs on (created on first use)."""
    node_id = ray.get_runtime_context().get_node_id()
    actor = ray.remote(StoreActor).options(
        name=f"{namespace}-store-{node_id}",
        namespace=namespace,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_concurrency=8,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(settings, fingerprint, node_id)
    return RemoteStore(actor)
