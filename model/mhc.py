"""mHC: four residual streams mixed at every sublayer, with V4.1's single-pass rule.

At each site (before attention, before the FFN) one linear projection of the
RMS-normalised, flattened streams gives three mixes:

- ``pre``  [hc]     how much of each stream goes into a sublayer's input,
- ``post`` [hc]     how much of the sublayer's output goes into each stream,
- ``comb`` [hc, hc] how the streams shuffle among themselves, pushed onto the
  doubly-stochastic matrices by Sinkhorn iterations.

Single-pass mHC: the ``pre`` a site computes is used by the *next* site (attention
collapses its input with the previous site's ``pre``, the FFN with attention's), so
a fused kernel can read the streams once and write them once. The first site
collapses stream 0 only (a one-hot ``pre``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import rms_normalize


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project ``[..., hc, hc]`` logits towards a doubly-stochastic matrix.

    Softmax over rows first (one normalisation), then alternate column and row
    normalisation; ``iters`` counts normalisations after the softmax, ending on
    columns, as the release trains it.
    """
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_mixes(
    streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, eps: float, norm_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``streams`` [B, S, hc, D] -> (pre [B,S,hc], post [B,S,hc], comb [B,S,hc,hc]).

    ``fn`` is ``[(2 + hc) * hc, hc * D]``, ``base`` ``[(2 + hc) * hc]``, ``scale`` ``[3]``.
    The normalisation statistic is over the whole flattened ``hc * D`` stream.
    """
    hc = streams.shape[-2]
    flat = rms_normalize(streams.flatten(start_dim=-2).float(), norm_eps)
    mixes = F.linear(flat, fn.float())
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb_logits = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    return pre, post, sinkhorn(comb_logits, iters, eps)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the streams: [B, S, hc, D] x [B, S, hc] -> [B, S, D]."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


def expand(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: ``new_k = post_k * out + sum_j comb[j, k] * streams_j``."""
    mixed = torch.einsum("...jk,...jd->...kd", comb.float(), streams.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(streams.dtype)


def first_pre(streams: torch.Tensor) -> torch.Tensor:
    """The one-hot ``pre`` of the first site: [B, S, hc] selecting stream 0."""
    pre = streams.new_zeros(streams.shape[:-1], dtype=torch.float32)
    pre[..., 0] = 1.0
    return pre
