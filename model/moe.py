"""Mixture of experts: one shared expert plus top-k of N routed SwiGLU experts.

Router (DeepSeek's auxiliary-loss-free balancing, V4.1 flavour):
``score = sqrt(softplus(x @ W.T / gate_temp))``; experts are *selected* by
``score + bias`` (a separate ``bias_vl`` for image tokens), but *weighted* by the raw
scores of the selected experts, normalised to sum to one and times
``routed_scaling_factor`` (1.5). Inside each expert the up branch is clamped to
``[-limit, limit]`` and the gate branch from above, keeping FP8/FP4 activations in range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


class Router(nn.Module):
    """Top-k expert choice: returns (weights [N, k] fp32, indices [N, k])."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, scoring_func: str, gate_temp: float,
                 norm_topk_prob: bool, scaling: float):
        super().__init__()
        self.top_k, self.scoring_func, self.gate_temp = top_k, scoring_func, gate_temp
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling
        self.weight = nn.Parameter(torch.empty(n_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(n_experts))
        self.bias_vl = nn.Parameter(torch.zeros(n_experts))

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        bias = self.bias.float()
        if image_mask is not None:
            bias = torch.where(image_mask.reshape(-1, 1), self.bias_vl.float(), bias)
        return route(x, self.weight, bias, self.top_k, self.scoring_func, self.gate_temp, self.norm_topk_prob,
                     self.scaling)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scoring_func: str,
          gate_temp: float, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`Router` as a function of its weights: (weights [N, k] fp32, indices [N, k])."""
    scores = _score(F.linear(x.float(), weight.float()) / gate_temp, scoring_func)
    indices = (scores + bias).topk(top_k, dim=-1).indices
    weights = scores.gather(-1, indices)
    if norm_topk_prob and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, indices


class Expert(nn.Module):
    """SwiGLU block: ``w2(silu(clamp(w1 x)) * clamp(w3 x))`` (optionally weighted before w2)."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return expert(x, self.w1.weight, self.w3.weight, self.w2.weight, self.limit, weight)


def expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float,
           weight: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`Expert` as a function of its weights."""
    return F.linear(swiglu(F.linear(x, w1).float(), F.linear(x, w3).float(), limit, weight).to(x.dtype), w2)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The expert's activation of its two projections (clamped at ``limit`` > 0),
    times the routing ``weight`` if given."""
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    y = F.silu(gate) * up
    return y if weight is None else y * weight


class MoE(nn.Module):
    """Shared expert + routed experts. ``forward`` takes ``[..., D]``, returns the same shape."""

    def __init__(self, hidden: int, inter: int, n_experts: int, top_k: int, limit: float, scoring_func: str,
                 gate_temp: float, norm_topk_prob: bool, scaling: float):
        super().__init__()
        self.gate = Router(hidden, n_experts, top_k, scoring_func, gate_temp, norm_topk_prob, scaling)
        self.experts = nn.ModuleList(Expert(hidden, inter, limit) for _ in range(n_experts))
        self.shared_experts = Expert(hidden, inter, limit)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat, image_mask)
        groups = ExpertGroups.of(weights, indices, len(self.experts))
        outputs = [expert(flat[rows], w) if len(rows) else None
                   for expert, (rows, w) in zip(self.experts, groups.split())]
        return groups.combine(self.shared_experts(flat), outputs).to(x.dtype).reshape(shape)


class ExpertGroups:
    """The dispatch of one MoE call: its (token, slot) pairs grouped by expert, in
    expert order (each expert then runs once over its tokens), and the combine that
    adds the experts' weighted outputs back in that same order."""

    def __init__(self, tokens: torch.Tensor, weights: torch.Tensor, counts: list[int]):
        self.tokens, self.weights, self.counts = tokens, weights, counts
        self.starts = [0]
        for count in counts:
            self.starts.append(self.starts[-1] + count)

    @classmethod
    def of(cls, weights: torch.Tensor, indices: torch.Tensor, n_experts: int) -> "ExpertGroups":
        """From the router's (weights [N, k], indices [N, k])."""
        order = indices.flatten().argsort(stable=True)
        counts = torch.bincount(indices.flatten(), minlength=n_experts).tolist()
        return cls(order // indices.shape[1], weights.flatten()[order], counts)

    def split(self, experts: range | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(token rows, routing weights [n, 1]) of each expert of ``experts`` (default all)."""
        experts = range(len(self.counts)) if experts is None else experts
        return [(self.tokens[self.starts[e]:self.starts[e + 1]], self.weights[self.starts[e]:self.starts[e + 1], None])
                for e in experts]

    def span(self, experts: range) -> slice:
        """Where ``experts``' pairs lie in the grouped order."""
        return slice(self.starts[experts.start], self.starts[experts.stop])

    def combine(self, shared: torch.Tensor, outputs: list[torch.Tensor | None]) -> torch.Tensor:
        """``shared`` [N, D] plus every expert's weighted output (``outputs[e]``, one row
        per pair of expert ``e``, None for an expert with none), fp32."""
        out = shared.float()
        routed = torch.zeros_like(out)
        for e, y in enumerate(outputs):
            if y is not None:
                routed.index_add_(0, self.tokens[self.starts[e]:self.starts[e + 1]], y.float())
        return routed + out
