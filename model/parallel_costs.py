"""What one replica split over workers holds and moves (``v41 params --parallel``).

From the config alone, counted on PyTorch's meta device: the modules a pool's replica
holds (:func:`pool_modules`), the stored bytes each worker of an
:class:`~model.parallel.ExpertShard` split holds (:func:`worker_bytes`), and what a
token costs to move between the workers (:func:`token_traffic`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .accounting import _stored_bytes
from .config import ModelConfig
from .loader import build_modules
from .parallel import ExpertShard, ParallelSpec, routed_expert


def pool_modules(config: ModelConfig, pool: str) -> dict[str, torch.nn.Module]:
    """The modules a pool's replica holds, built on meta: the decoder pool the whole
    backbone and the drafter, the prefill pool the encoder half (with the CED projection).
    Neither holds the Engram tables (the table service on CPU hosts does) nor the
    vision tower."""
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
    shard = ExpertShard(0, spec.experts, config.text.n_routed_experts)
    totals = [0] * spec.experts
    for part, name, param in _held(pool_modules(config, pool)):
        expert = routed_expert(name) if part == "backbone" else None  # the drafter stays whole on the lead
        totals[0 if expert is None else shard.owner(expert)] += _stored_bytes(name, param.shape)
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
