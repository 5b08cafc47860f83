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

Nothing here runs anything: the split itself (:class:`ExpertShard`), what each worker
holds (:func:`worker_bytes`) and what a token costs to move (:func:`token_traffic`),
all from the config, counted on PyTorch's meta device. The exchange is
:mod:`model.runtime.parallel`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from .config import ModelConfig

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
        match = _ROUTED.match(name)
        if match is None:
            return self.rank == 0
        return int(match.group(2)) in self.experts


def pool_modules(config: ModelConfig, pool: str) -> dict[str, torch.nn.Module]:
    """The modules a pool's replica holds, built on meta: the decoder pool the whole
    backbone and the drafter, the prefill pool the encoder half (with the CED projection).
    Neither holds the Engram tables (the table service on CPU hosts does) nor the
    vision tower."""
    from .loader import build_modules

    if pool not in ("decoder", "prefill"):
        raise ValueError(f"pool must be decoder or prefill, got {pool!r}")
    parts = build_modules(dataclasses.replace(config, vision=None), "meta")
    if pool == "prefill":
        parts.backbone.keep_encoder_only()
        return {"backbone": parts.backbone}
    return {"backbone": parts.backbone, **({"drafter": parts.drafter} if parts.drafter is not None else {})}


def _held(modules: dict[str, torch.nn.Module]):
    for part, module in modules.items():
        for name, param in module.named_parameters():
            if name.endswith((".engram.embed.weight", ".engram.embed.scale")):
                continue  # the Engram tables live in the table service
            yield part, name, param


def worker_bytes(config: ModelConfig, spec: ParallelSpec, pool: str = "decoder") -> list[int]:
    """Stored bytes (the checkpoint's formats) each of ``spec.experts`` workers of one
    replica of ``pool`` holds; they add up to what one unsplit replica holds."""
    from .accounting import _stored_bytes

    shard = ExpertShard(0, spec.experts, config.text.n_routed_experts)
    totals = [0] * spec.experts
    for part, name, param in _held(pool_modules(config, pool)):
        routed = _ROUTED.match(name) if part == "backbone" else None  # the drafter stays whole on the lead
        totals[shard.owner(int(routed.group(2))) if routed else 0] += _stored_bytes(name, param.shape)
    return totals


@dataclass(frozen=True)
class TokenTraffic:
    """What one token moves between a replica's workers, per pass through its layers:
    each (token, expert) pair whose expert is on another worker sends the token's
    hidden state and routing weight there, and gets the weighted output back."""

    moe_layers: int
    remote_fraction: float
    bytes_out: float
    bytes_back: float

    @property
    def bytes_total(self) -> float:
        return self.bytes_out + self.bytes_back


def token_traffic(config: ModelConfig, spec: ParallelSpec, pool: str = "decoder",
                  activation_bytes: int = 2) -> TokenTraffic:
    """Expected bytes per token (routing spread evenly over the experts; activations of
    ``activation_bytes``: 2 for BF16 on GPUs, 4 for this CPU build's fp32)."""
    text = config.text
    layers = text.decoder_start if pool == "prefill" else text.num_hidden_layers
    remote = (spec.experts - 1) / spec.experts
    pairs = layers * text.num_experts_per_tok * remote
    hidden = text.hidden_size * activation_bytes
    return TokenTraffic(layers, remote, pairs * (hidden + 4), pairs * hidden)
