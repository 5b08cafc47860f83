"""How one replica's model is split over several workers (devices, or CPU processes).

Expert parallelism, with the attention on the lead worker. Rank 0 (the lead) runs
everything a token flows through but the routed experts: embeddings, attention and
its caches, mHC, the Engram write (its rows come from the table service), the routers,
the shared experts, the head and the DSpark drafter. The routed experts of every MoE
layer are split into ``workers`` contiguous ranges, one per worker, the lead's
included: each worker holds ``n_routed_experts / workers`` of every layer.

Why not split the attention too: a CSA2 layer's output projection is grouped (each
group of heads has its own low-rank ``wo_a``), and its indexer scores all heads'
queries against one shared key cache, so heads split cleanly only in whole output
groups, with the indexer's top-k (one choice per token for all heads) computed where
every head's score meets. That is tensor parallelism's next step; the experts are
where the bytes are (543.6B of the released 551.9B backbone parameters), so splitting
them alone already fits the released model on 8 devices with most of the lead's
memory left for caches (``v41 params --parallel experts=8``).

Nothing here runs anything: this is the split itself (:class:`ExpertShard`); what each
worker holds and what a token costs to move are counted in :mod:`model.parallel_costs`,
the exchange is :mod:`model.runtime.parallel`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ROUTED = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.")


@dataclass(frozen=True)
class ParallelSpec:
    """A pool's split: ``experts`` workers share the routed experts; ``tensor`` (the
    attention's heads split) is not built: it must be 1."""

    experts: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        if self.experts < 1:
            raise ValueError(f"experts must be at least 1, got {self.experts}")
        if self.tensor != 1:
            raise ValueError(f"tensor parallelism is not built (tensor must be 1, got {self.tensor}); "
                             "the attention runs on the lead worker, see model/parallel.py")

    @classmethod
    def parse(cls, text: str) -> "ParallelSpec":
        """``experts=8`` or ``experts=8,tensor=1``."""
        values: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in ("experts", "tensor") or not value.strip().isdigit():
                raise ValueError(f"expected experts=N[,tensor=M], got {text!r}")
            values[key.strip()] = int(value)
        return cls(**values)


@dataclass(frozen=True)
class ExpertShard:
    """Worker ``rank`` of ``workers``: which routed experts it holds, and which of a
    checkpoint's tensors it reads (:meth:`holds`)."""

    rank: int
    workers: int
    n_experts: int

    def __post_init__(self) -> None:
        if self.workers < 1 or not 0 <= self.rank < self.workers:
            raise ValueError(f"rank {self.rank} of {self.workers} workers")
        if self.n_experts % self.workers:
            raise ValueError(f"{self.n_experts} routed experts do not split evenly over {self.workers} workers")

    @property
    def per_worker(self) -> int:
        return self.n_experts // self.workers

    @property
    def experts(self) -> range:
        return range(self.rank * self.per_worker, (self.rank + 1) * self.per_worker)

    def owner(self, expert: int) -> int:
        return expert // self.per_worker

    def holds(self, name: str) -> bool:
        """Whether this worker holds the backbone parameter (or stored tensor) ``name``
        (after the loader's renaming; a ``.scale`` goes with its weight): the lead holds
        everything but the other workers' routed experts, the others only their own."""
        expert = routed_expert(name)
        if expert is None:
            return self.rank == 0
        return expert in self.experts


def routed_expert(name: str) -> int | None:
    """The routed expert whose parameter (or stored tensor) ``name`` is, or None."""
    match = _ROUTED.match(name)
    return None if match is None else int(match.group(2))
