"""The workers of an expert-parallel replica, and how a replica starts them.

A replica whose pool is split ``experts=N`` is its own process (the lead, rank 0,
which runs the engine) plus N-1 expert workers, each holding 1/N of every MoE layer's
routed experts (:mod:`model.parallel`, :mod:`model.runtime.parallel`). Under Ray the
workers are actors in a placement group the replica creates: they are the replica's
(owned by it, gone with it), and a lost worker breaks the replica's link, fails its
health check, and Serve starts the whole replica again. Without Ray (tests, a
one-machine run) they are plain processes (:class:`LocalExpertWorkers`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from model.parallel import ExpertShard

WORKER_PREFIX = "v41-expert-worker-"  # + the lead's pid and the worker's rank: one Ray actor name each


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of one replica is told: where the checkpoint is, how the
    experts split, which layers it serves, and the rendezvous address."""

    directory: str
    workers: int
    address: str
    layers: tuple[int, ...] | None = None  # the prefill pool's encoder layers; None: all
    threads: int = 1

    @classmethod
    def of(cls, directory: str | Path, workers: int, host: str, drop_decoder: bool, threads: int) -> WorkerSpec:
        """A replica's spec: a free rendezvous port on ``host``; a prefill replica's
        workers serve the encoder layers only."""
        from model.config import ModelConfig
        from storage.redis_server import free_port

        layers = tuple(range(ModelConfig.load(directory).text.decoder_start)) if drop_decoder else None
        return cls(str(directory), workers, f"{host}:{free_port()}", layers, threads)


def expert_worker(spec: WorkerSpec, rank: int) -> int:
    """A worker process's life: load its share, join the lead, answer until told to stop."""
    from model.config import ModelConfig
    from model.loader import load_experts
    from model.runtime.parallel import join, serve_experts

    torch.set_num_threads(spec.threads)
    text = ModelConfig.load(spec.directory).text
    shard = ExpertShard(rank, spec.workers, text.n_routed_experts)
    experts = load_experts(spec.directory, shard, spec.layers)
    group = join(spec.address, rank, spec.workers)
    return serve_experts(group, experts, shard, text.hidden_size, torch.float32)


def lead(directory: str | Path, workers: int, drop_decoder: bool = False):
    """Load the lead's share of a checkpoint (before joining, while the workers load
    theirs): returns (checkpoint, link); :func:`connect` then joins and attaches."""
    from actors.pool_model import pool_checkpoint
    from model.config import ModelConfig
    from model.runtime.parallel import ExpertLink

    text = ModelConfig.load(directory).text
    shard = ExpertShard(0, workers, text.n_routed_experts)
    return pool_checkpoint(directory, drop_decoder, shard), ExpertLink(shard, text.hidden_size)


def connect(checkpoint, link, address: str) -> None:
    """Join the replica's group as the lead and route the backbone's MoE layers through ``link``."""
    from model.runtime.parallel import attach

    link.connect(address)
    attach(checkpoint.backbone, link)


class LocalExpertWorkers:
    """A split replica on this machine without Ray: the calling process is the lead, the
    workers are spawned processes. ``with LocalExpertWorkers(dir, 2) as (checkpoint, link):``."""

    def __init__(self, directory: str | Path, workers: int, drop_decoder: bool = False, threads: int | None = None):
        self.spec = WorkerSpec.of(directory, workers, "127.0.0.1", drop_decoder, threads or torch.get_num_threads())
        self.drop_decoder = drop_decoder
        self.processes: list[subprocess.Popen] = []
        self.link = None

    def __enter__(self):
        spec = json.dumps(dataclasses.asdict(self.spec))
        self.processes = [subprocess.Popen([sys.executable, "-m", __name__, spec, str(rank)])
                          for rank in range(1, self.spec.workers)]
        checkpoint, self.link = lead(self.spec.directory, self.spec.workers, self.drop_decoder)
        connect(checkpoint, self.link, self.spec.address)
        return checkpoint, self.link

    def __exit__(self, *exc) -> None:
        if self.link is not None:
            self.link.close()
        deadline = time.monotonic() + 10
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class RayExpertWorkers:
    """A split replica under Ray: the Serve replica is the lead; its workers are actors
    in a placement group it owns (one bundle of ``resources`` per worker, packed onto
    as few nodes as fit)."""

    def __init__(self, directory: str | Path, workers: int, resources: dict[str, float],
                 drop_decoder: bool = False, threads: int = 1, ready_timeout_s: float = 120.0):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.spec = WorkerSpec.of(directory, workers, ray.util.get_node_ip_address(), drop_decoder, threads)
        self.group = placement_group([dict(resources) for _ in range(workers - 1)], strategy="PACK")
        ray.get(self.group.ready(), timeout=ready_timeout_s)
        actor = ray.remote(_ExpertWorkerActor)
        self.actors = [
            actor.options(num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                          resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, index),
                          max_restarts=0, max_concurrency=2, name=f"{WORKER_PREFIX}{os.getpid()}-{index + 1}",
                          namespace="v41").remote()
            for index in range(workers - 1)
        ]
        self.runs = [worker.run.remote(self.spec, rank) for rank, worker in enumerate(self.actors, start=1)]
        self.checkpoint, self.link = lead(directory, workers, drop_decoder)
        connect(self.checkpoint, self.link, self.spec.address)


class _ExpertWorkerActor:
    """The Ray actor of one expert worker (its ``run`` lasts as long as the replica)."""

    def run(self, spec: WorkerSpec, rank: int) -> int:
        return expert_worker(spec, rank)

    def pid(self) -> int:
        return os.getpid()


if __name__ == "__main__":  # a LocalExpertWorkers worker: python -m actors.expert_workers SPEC RANK
    raw = json.loads(sys.argv[1])
    expert_worker(WorkerSpec(**{**raw, "layers": None if raw["layers"] is None else tuple(raw["layers"])}),
                  int(sys.argv[2]))
