"""Rotary position embeddings of V4.1: interleaved pairs on the trailing slice.

Two rotary embeddings exist: ``main`` (plain base 10000, used by the window-only
layers) and ``compress`` (base 160000 with YaRN, used by every layer that has a
compressed branch, for its queries, its window keys, its compressed entries and its
indexer). Only the last ``qk_rope_head_dim`` channels of a vector rotate; adjacent
channels (even, odd) form one complex pair.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import RopeSpec


def inv_frequencies(spec: RopeSpec, rope_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[rope_dim // 2]`` (fp32), YaRN-blended when asked.

    YaRN interpolates the frequencies that rotate fewer than ``beta_slow`` times
    over the original context by ``factor``, keeps those rotating more than
    ``beta_fast`` times, and ramps linearly in between.
    """
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    pos_freqs = spec.theta**exponents
    extrapolated = 1.0 / pos_freqs
    if spec.rope_type == "default":
        return extrapolated
    interpolated = 1.0 / (spec.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        ratio = spec.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rope_dim * math.log(ratio) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the unscaled frequency
    return interpolated * (1 - keep) + extrapolated * keep


class Rotary(nn.Module):
    """cos/sin tables for absolute positions: ``(cos, sin)`` each ``[..., rope_dim // 2]``."""

    def __init__(self, spec: RopeSpec, rope_dim: int):
        super().__init__()
        self.spec = spec
        self.rope_dim = rope_dim
        self.register_buffer("inv_freq", inv_frequencies(spec, rope_dim), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        scale = self.spec.attention_factor
        return freqs.cos() * scale, freqs.sin() * scale


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` in adjacent pairs.

    ``x`` is ``[B, S, D]`` or ``[B, S, H, D]``; ``cos``/``sin`` are ``[B, S, R/2]``
    (broadcast over heads). ``inverse`` applies the conjugate rotation (used to take
    the query's rotation back off the attention output, whose values carry RoPE
    because keys and values are the same rotated vector).
    """
    if inverse:
        sin = -sin
    rope_dim = cos.shape[-1] * 2
    if x.ndim == 4:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    even, odd = rope[..., 0::2].float(), rope[..., 1::2].float()
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)
