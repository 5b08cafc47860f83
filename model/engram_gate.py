"""The Engram write: a layer's table and the gate that adds its rows to the mHC streams.

Steps 4 and 5 of the pipeline in :mod:`model.engram`: :meth:`EngramGate.lookup`
fetches the rows the hasher named (the serving system may fetch them remotely
instead and hand them in), and :meth:`EngramGate.forward` writes them: one key per
stream plus a shared value from the rows,
``out = h + sigmoid(signed_sqrt(<h, key>_normalised)) * value``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .engram import config_value

# The UE8M0-style scales of FP8 Engram rows cover this many channels each.
SCALE_BLOCK = 32

# Clamp of |dot| before the signed square root of the gate (the training kernel's).
GATE_CLAMP = 1e-6


class EngramEmbedding(nn.Module):
    """One Engram table: ``weight [rows, head_dim]`` and ``scale [rows, head_dim // 32]``.

    When the weight is stored as ``float8_e4m3fn`` a looked-up row is dequantised by
    its per-32-channel power-of-two scales; in a float dtype the weight holds the
    dequantised values already and the scales are unused. The scale has
    ``head_dim // 32`` columns whatever the width, as the release sizes it: none for a
    table narrower than 32 (such a table is only ever stored in a float dtype).
    """

    def __init__(self, num_embeddings: int, head_dim: int, device=None, dtype=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.head_dim = head_dim
        self.block = SCALE_BLOCK
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_embeddings, head_dim, **factory))
        self.scale = nn.Parameter(torch.ones(num_embeddings, head_dim // SCALE_BLOCK, **factory))

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(row_ids, self.weight)
        if self.weight.dtype == torch.float8_e4m3fn:
            if self.head_dim % self.block:
                raise ValueError(f"an FP8 Engram table needs a multiple of {self.block} channels, not {self.head_dim}")
            scales = F.embedding(row_ids, self.scale).float()
            rows = (rows.float().unflatten(-1, (-1, self.block)) * scales.unsqueeze(-1)).flatten(-2)
        return rows


class EngramGate(nn.Module):
    """The Engram write before one layer.

    Parameter names follow the checkpoint (``model.layers.{i}.engram.*``)::

        embed.weight [rows, head_dim]           embed.scale [rows, head_dim // 32]
        wkv.weight   [(hc + 1) * hidden, n_cols * head_dim]
        q_weight     [hc, hidden]               k_weight    [hc, hidden]

    ``lookup(row_ids)`` fetches the rows; ``forward(streams, rows, token_mask)`` gates
    them into the streams.  The two are separate so a remote table service can do the
    fetch.
    """

    def __init__(
        self,
        num_embeddings: int,
        head_dim: int,
        n_cols: int,
        hidden_size: int,
        hc_mult: int,
        eps: float,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.n_cols = n_cols
        self.head_dim = head_dim
        self.hidden_size = hidden_size
        self.hc_mult = hc_mult
        self.eps = eps
        factory = {"device": device, "dtype": dtype}
        self.embed = EngramEmbedding(num_embeddings, head_dim, **factory)
        self.wkv = nn.Linear(n_cols * head_dim, (hc_mult + 1) * hidden_size, bias=False, **factory)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, **factory))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, **factory))

    @classmethod
    def from_config(cls, config: Any, layer_id: int, device=None, dtype=None) -> "EngramGate":
        """The gate of model layer ``layer_id`` (must be one of ``engram_layer_ids``).
        Needs ``hidden_size``, ``hc_mult`` and ``rms_norm_eps`` besides the Engram fields."""
        layer_ids = [int(i) for i in config_value(config, "engram_layer_ids")]
        if layer_id not in layer_ids:
            raise ValueError(f"layer {layer_id} is not an Engram layer ({layer_ids})")
        index = layer_ids.index(layer_id)
        return cls(
            num_embeddings=int(config_value(config, "engram_num_embeddings")[index]),
            head_dim=int(config_value(config, "engram_head_dim")),
            n_cols=(int(config_value(config, "engram_max_ngram_size")) - 1) * int(config_value(config, "engram_n_heads")),
            hidden_size=int(config_value(config, "hidden_size")),
            hc_mult=int(config_value(config, "hc_mult")),
            eps=float(config_value(config, "rms_norm_eps")),
            device=device,
            dtype=dtype,
        )

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        """``row_ids [B, S, n_cols]`` (one layer's slice of the hasher output) ->
        ``rows [B, S, n_cols, head_dim]`` float32."""
        return self.embed(row_ids).float()

    def gate(self, streams: torch.Tensor, rows: torch.Tensor, token_mask: torch.Tensor | None = None):
        """``(gate [B, S, hc], value [B, S, D])`` in float32 (:func:`gate`)."""
        return gate(streams, rows, self.wkv.weight, self.q_weight, self.k_weight, self.eps, token_mask)

    def forward(
        self, streams: torch.Tensor, rows: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """streams ``[B, S, hc, D]``; rows ``[B, S, n_cols, head_dim]`` from
        :meth:`lookup` (integer row ids ``[B, S, n_cols]`` are looked up here);
        token_mask ``[B, S]``, False shuts the gate (image tokens, padding).
        Returns ``streams + gate * value`` in the dtype of ``streams``."""
        if not rows.is_floating_point():
            rows = self.lookup(rows)
        return write(streams, rows, self.wkv.weight, self.q_weight, self.k_weight, self.eps, token_mask)


def gate(streams: torch.Tensor, rows: torch.Tensor, wkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
         eps: float, token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate of each stream and the shared value of Engram ``rows`` [..., n_cols,
    head_dim] for ``streams`` [..., hc, D], as functions of the gate's weights (``wkv``
    [(hc + 1) * D, n_cols * head_dim], ``q_weight`` and ``k_weight`` [hc, D]): (gate
    [..., hc], value [..., D]) in float32; ``token_mask`` False shuts a token's gate."""
    hc_mult, hidden = q_weight.shape
    kv = F.linear(rows.flatten(-2).to(wkv.dtype), wkv).float()
    key, value = kv.split([hc_mult * hidden, hidden], dim=-1)
    key = key.unflatten(-1, (hc_mult, hidden))
    h = streams.float()
    qk = q_weight.float() * k_weight.float()
    # Normalised per (token, stream) over D, both the stream and its key.
    inv = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * qk * key).sum(-1) * inv / hidden**0.5
    # Signed square root (copysign: +0 counts as positive), then the sigmoid.
    gated = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
    if token_mask is not None:
        gated = gated.masked_fill(~token_mask.bool().unsqueeze(-1), 0.0)
    return gated, value


def write(streams: torch.Tensor, rows: torch.Tensor, wkv: torch.Tensor, q_weight: torch.Tensor,
          k_weight: torch.Tensor, eps: float, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`EngramGate.forward` of looked-up ``rows`` as a function of the gate's
    weights (:func:`gate`): ``streams + gate * value`` in the dtype of ``streams``."""
    gated, value = gate(streams, rows, wkv, q_weight, k_weight, eps, token_mask)
    return (streams.float() + gated.unsqueeze(-1) * value.unsqueeze(-2)).to(streams.dtype)
