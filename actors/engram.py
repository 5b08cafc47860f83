"""The Engram table service on Ray: shard actors on CPU hosts, and the transport to them.

V4.1's two Engram tables are 183 GiB of FP8 that are only ever looked up, and the
rows a prompt needs follow from its token ids alone. So they live in the RAM of CPU
hosts, cut into shards (:class:`~actors.engram_tables.ShardPlan`: the same row range
of every table), each shard held by ``replicas`` actors placed on nodes that offer the
custom resource ``resource`` (``ray start --resources '{"engram_host": 8}'`` makes a
node hold up to 8 shard actors at the default ``resource_per_shard = 1``). Every host
must see the checkpoint at the same path; an actor memory-maps its byte ranges of
the safetensors files, so start-up reads and copies nothing and a host needs no free
RAM for the table beyond the page cache.

The router calls :meth:`EngramClient.start` as soon as a prompt is tokenized; the
prefill calls ``lookup.rows()`` right before its first Engram layer. A dead actor is
restarted by Ray (``max_restarts``) and a request in flight is re-sent to it
(``max_task_retries``); a silent one times out with an :class:`EngramServiceError`
after ``timeout_s`` unless another replica answers.

The actors are thin: :class:`~actors.engram_tables.EngramShard` reads,
:class:`~actors.engram_client.EngramClient` routes; both run without Ray.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from .engram_client import EngramClient, EngramLookup, EngramServiceError, ShardFailure, ShardTimeout, ShardTransport
from .engram_tables import EngramShard, ShardPlan, ShardRequest, ShardRows, read_engram_tables

__all__ = [
    "EngramClient",
    "EngramLookup",
    "EngramService",
    "EngramServiceConfig",
    "EngramServiceError",
    "EngramShardActor",
    "RayTransport",
    "ShardPlacement",
]


@dataclass(frozen=True)
class EngramServiceConfig:
    """How the Engram service is laid out on the cluster.

    ``checkpoint``: checkpoint directory (same path on every Engram host).
    ``n_shards`` x ``replicas`` actors, each asking ``resource_per_shard`` of the custom
    resource ``resource`` and ``num_cpus`` CPUs; replicas of a shard are spread over
    nodes where possible. ``timeout_s`` / ``retries``: see
    :class:`~actors.engram_client.EngramClient`. ``max_restarts``: Ray restarts of a
    dead shard actor. ``max_concurrency``: requests one actor serves at a time.
    ``ready_timeout_s``: how long :meth:`EngramService.launch` waits for placement.
    """

    checkpoint: str
    n_shards: int = 1
    replicas: int = 1
    resource: str = "engram_host"
    resource_per_shard: float = 1.0
    num_cpus: float = 1.0
    timeout_s: float = 5.0
    retries: int = 1
    max_restarts: int = 8
    max_concurrency: int = 2
    ready_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.n_shards < 1 or self.replicas < 1:
            raise ValueError(f"need n_shards >= 1 and replicas >= 1, got {self.n_shards}, {self.replicas}")
        if self.resource_per_shard <= 0:
            raise ValueError("resource_per_shard must be > 0 (placement is by the Engram resource)")


@dataclass(frozen=True)
class ShardPlacement:
    """Where one shard replica runs: its Ray node id, host name and process id."""

    shard: int
    replica: int
    node_id: str
    hostname: str
    pid: int
    mapped_bytes: int


class EngramShardActor:
    """Ray actor around one :class:`EngramShard` (wrapped by ``ray.remote`` at launch)."""

    def __init__(self, plan: ShardPlan, shard: int, replica: int):
        self._shard = EngramShard(plan, shard)
        self._replica = replica

    def fetch(self, request: ShardRequest) -> ShardRows:
        return self._shard.fetch(request)

    def placement(self) -> ShardPlacement:
        return ShardPlacement(
            shard=self._shard.shard,
            replica=self._replica,
            node_id=ray.get_runtime_context().get_node_id(),
            hostname=os.uname().nodename,
            pid=os.getpid(),
            mapped_bytes=self._shard.plan.shard_bytes(self._shard.shard),
        )


class RayTransport(ShardTransport):
    """Requests as actor calls; handles are ``ObjectRef`` s (picklable, so a lookup can
    travel from the router to a prefill actor)."""

    def __init__(self, actors: list[list[Any]]):
        self.actors = actors  # [shard][replica] actor handles
        self.n_shards, self.n_replicas = len(actors), len(actors[0])

    def submit(self, shard: int, replica: int, request: ShardRequest) -> ray.ObjectRef:
        return self.actors[shard][replica].fetch.remote(request)

    def result(self, handle: ray.ObjectRef, timeout_s: float) -> ShardRows:
        try:
            return ray.get(handle, timeout=timeout_s)
        except GetTimeoutError:
            raise ShardTimeout() from None
        except RayError as error:  # actor died / unavailable, task raised, object lost
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise ShardFailure(f"{type(error).__name__}: {first_line}") from error


class EngramService:
    """The shard actors of one checkpoint's Engram tables, and clients for them."""

    def __init__(self, config: EngramServiceConfig, plan: ShardPlan, actors: list[list[Any]]):
        self.config = config
        self.plan = plan
        self.actors = actors  # [shard][replica]

    @classmethod
    def launch(cls, config: EngramServiceConfig, layer_ids: tuple[int, ...] | list[int] | None = None) -> "EngramService":
        """Create the actors on the connected Ray cluster and wait until each has mapped
        its shard. ``layer_ids`` default to the checkpoint config's ``engram_layer_ids``.
        Raises :class:`EngramServiceError` when the cluster offers too little of the
        Engram resource or the actors are not placed within ``ready_timeout_s``."""
        if layer_ids is None:
            from model.config import ModelConfig

            layer_ids = ModelConfig.load(Path(config.checkpoint)).text.engram_layer_ids
        plan = ShardPlan.even(read_engram_tables(config.checkpoint, tuple(layer_ids)), config.n_shards)
        needed = config.n_shards * config.replicas * config.resource_per_shard
        offered = ray.cluster_resources().get(config.resource, 0.0)
        if offered < needed:
            raise EngramServiceError(
                f"the Engram service needs {needed:g} of resource {config.resource!r} "
                f"({config.n_shards} shards x {config.replicas} replicas x {config.resource_per_shard:g}); "
                f"the cluster offers {offered:g} (start Engram hosts with --resources '{{\"{config.resource}\": N}}')"
            )
        remote = ray.remote(EngramShardActor).options(
            resources={config.resource: config.resource_per_shard},
            num_cpus=config.num_cpus,
            max_restarts=config.max_restarts,
            max_task_retries=config.retries,  # lookups are reads: re-running one is safe
            max_concurrency=config.max_concurrency,
            scheduling_strategy="SPREAD",
        )
        actors = [
            [remote.remote(plan, shard, replica) for replica in range(config.replicas)]
            for shard in range(config.n_shards)
        ]
        service = cls(config, plan, actors)
        try:
            service.placement(timeout_s=config.ready_timeout_s)
        except EngramServiceError:
            service.shutdown()
            raise
        return service

    def client(self, hasher: Any = None, timeout_s: float | None = None) -> EngramClient:
        """A client for this service (picklable: hand it to router and prefill actors);
        ``timeout_s`` overrides the config's."""
        return EngramClient(
            self.plan,
            RayTransport(self.actors),
            timeout_s=self.config.timeout_s if timeout_s is None else timeout_s,
            retries=self.config.retries,
            hasher=hasher,
        )

    def placement(self, timeout_s: float = 30.0) -> list[ShardPlacement]:
        """Where every shard replica runs (waits for the actors to be up)."""
        refs = [actor.placement.remote() for replicas in self.actors for actor in replicas]
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            raise EngramServiceError(
                f"Engram shard actors not running after {timeout_s:g} s: are there nodes offering "
                f"{self.config.resource!r} and {self.config.num_cpus:g} CPU per shard?"
            ) from None
        except RayError as error:
            raise EngramServiceError(f"Engram shard actors failed to start: {error}") from error

    def shutdown(self) -> None:
        """Kill every shard actor (no restart)."""
        for replicas in self.actors:
            for actor in replicas:
                ray.kill(actor, no_restart=True)
        self.actors = []


class EngramServiceHolder:
    """A detached actor that owns one deployment's shard actors, so that every router
    replica shares them (the shards live as long as the holder)."""

    def __init__(self, config: EngramServiceConfig):
        self.service = EngramService.launch(config)

    def client(self) -> EngramClient:
        return self.service.client()

    def placement(self) -> list[ShardPlacement]:
        return self.service.placement()


def shared_engram_service(config: EngramServiceConfig, name: str = "v41-engram", namespace: str = "v41"):
    """The holder actor of the named Engram service, launched on first use."""
    return ray.remote(EngramServiceHolder).options(
        name=name, namespace=namespace, get_if_exists=True, lifetime="detached", num_cpus=0,
    ).remote(config)
