"""CSA2: compressed sparse attention over a window and shared long-range memory.

Every layer attends to its own sliding window (the last ``sliding_window`` tokens,
FP8 in the cache). Layers with a compressed branch also attend to the long-range
entries that the indexer picked (FP4 in the cache):

- a **Full** layer pools its own hidden states into long-range entries (``ratio``
  tokens per entry with a learned softmax gate in the encoder, one per token in the
  decoder), derives the indexer keys from the same pooled latents, and runs its
  indexer;
- a **Reindex** layer reads the Full layer's entries and keys but scores them with
  its own indexer query, inside the candidate pool of the candidate-source layer
  (the hierarchical sparse indexer);
- a **Reuse** layer reads the entries and the picks of the last indexer.

Keys and values are one shared vector per place (MQA with K = V); the values carry
the query's RoPE, which the output takes back off before the grouped low-rank
output projection. Each head has a learned sink logit that only grows the softmax
denominator.

This module holds the math of one layer as small methods; which places each query
reads, and the indexer's selection (scores -> candidate blocks -> top-k) that every
path runs, are :mod:`model.selection`.
The orchestration over a whole sequence lives in :mod:`model.transformer` (the
reference forward and the one block loop); the engine calls the same methods over its
caches (:mod:`model.runtime.gather`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import AttentionMode, LayerPlan, TextConfig
from .formats import INDEXER_KEY, WINDOW_KV
from .norm import RMSNorm, rms_norm
from .rope import apply_rotary


class GroupedLinear(nn.Module):
    """Block-diagonal projection: ``groups`` independent ``in -> out`` maps.

    ``weight`` is ``[groups * out, in]`` (the checkpoint's ``wo_a``); input
    ``[..., groups, in]``, output ``[..., groups, out]``.
    """

    def __init__(self, in_per_group: int, out_per_group: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, self.groups)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """:class:`GroupedLinear` as a function of its weight ``[groups * out, in]``."""
    w = weight.view(groups, -1, weight.shape[-1])  # [G, out, in]
    return torch.einsum("...gi,goi->...go", x, w)


class Compressor(nn.Module):
    """Pools ``ratio`` consecutive hidden states into one long-range latent.

    At ratio 1 (the CED decoder's source) a latent is a plain per-token projection.
    Pooling runs in fp32: per channel, a softmax over the group's gate logits
    weights the group's projected values.
    """

    def __init__(self, config: TextConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        self.wgate = nn.Linear(config.hidden_size, config.head_dim, bias=False) if ratio > 1 else None
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, G * ratio, D] (whole groups) -> pre-RoPE latents [B, G, head_dim]."""
        return pool_latents(x, self.wkv.weight, None if self.wgate is None else self.wgate.weight, self.norm.weight,
                            self.ratio, self.norm.eps)


class Indexer(nn.Module):
    """The cheap attention that picks which long-range entries a query reads.

    Keys (one per entry, FP4) exist only on a Full layer: ``k_norm(wk(latent))``
    rotated at the entry's position. Query heads come from the attention's low-rank
    query residual; per-head weights from the hidden state. The score of an entry
    is ``sum_h w_h * relu(q_h . k) / sqrt(head_dim)``.
    """

    def __init__(self, config: TextConfig, owns_keys: bool):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def keys_raw(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE latents [B, G, head_dim] -> indexer keys before FP4 quantisation."""
        return index_keys_raw(latent, cos, sin, self.wk.weight, self.k_norm.weight, self.k_norm.eps)

    def scores(
        self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
        quantize: Callable[[torch.Tensor], torch.Tensor] = INDEXER_KEY.fake_quant,
    ) -> torch.Tensor:
        """Scores [B, S, T] of queries (hidden ``x`` [B, S, D]) against ``keys``: shared
        [B, T, d], or per query [B, S, T, d] (a Reindex layer scoring its candidates).
        ``quantize`` puts the queries in the keys' FP4 format (training passes its
        straight-through version)."""
        return self.score(*self.query(x, q_residual, cos, sin, quantize), keys)

    def query(
        self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        quantize: Callable[[torch.Tensor], torch.Tensor] = INDEXER_KEY.fake_quant,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token half of :meth:`scores`: query heads [B, S, H, d] (rotated, in the
        keys' format) and head weights [B, S, H]."""
        return indexer_query(x, q_residual, cos, sin, self.wq_b.weight, self.weights_proj.weight, self.n_heads,
                             quantize)

    def score(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The half of :meth:`scores` that reads keys: [B, S, T]."""
        return index_scores(q, weights, keys)


class CSA2Attention(nn.Module):
    """One layer's attention. Parameter names follow the released checkpoint."""

    def __init__(self, config: TextConfig, plan: LayerPlan):
        super().__init__()
        self.plan = plan
        self.n_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.o_groups = config.o_groups
        self.scaling = self.head_dim**-0.5
        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.wo_a = GroupedLinear(self.n_heads * self.head_dim // config.o_groups, config.o_lora_rank, config.o_groups)
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads))
        full = plan.mode is AttentionMode.FULL
        self.compressor = Compressor(config, plan.compress_ratio) if full else None
        self.indexer = Indexer(config, owns_keys=full) if plan.runs_indexer else None

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [B, S, D] -> (rotated queries [B, S, H, hd], low-rank residual [B, S, q_lora])."""
        return queries(x, cos, sin, self.wq_a.weight, self.q_norm.weight, self.wq_b.weight, self.n_heads,
                       self.q_norm.eps)

    def window_raw(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [B, S, D] -> window entries [B, S, hd] before FP8 quantisation (RoPE included)."""
        return window_raw(x, cos, sin, self.wkv.weight, self.kv_norm.weight, self.kv_norm.eps)

    def window_entries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [B, S, D] -> the window cache's entries [B, S, hd] (FP8 values)."""
        return WINDOW_KV.fake_quant(self.window_raw(x, cos, sin))

    def compress(self, x: torch.Tensor, positions: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """A Full layer's long-range entries and indexer keys, before quantisation, from
        the whole pooling groups of ``x`` [B, S, D] at ``positions`` [B, S] (an entry sits
        at its group's first position; a partial last group is left out). The keys take
        the latents without gradient: the indexer learns only from its own loss.
        ``rotary``: the compress-branch rotary embedding. Every path pools here."""
        ratio = self.plan.compress_ratio
        whole = x.shape[1] // ratio * ratio
        latent = self.compressor(x[:, :whole])
        cos, sin = rotary(positions[:, :whole:ratio])
        return self.compressed_raw(latent, cos, sin), self.indexer.keys_raw(latent.detach(), cos, sin)

    @staticmethod
    def compressed_raw(latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE latents [B, G, hd] -> long-range entries before FP4 quantisation."""
        return apply_rotary(latent, cos, sin)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Shared-KV attention with per-head sinks.

        ``q`` [B, S, H, hd], ``keys`` [B, T, hd] (keys and values; or each query's own
        [B, S, T, hd]), ``mask`` [B, S, T] bool (True = may attend). Returns [B, S, H,
        hd]. A row with nothing to attend gives zeros (the sink takes all the weight).
        """
        return attend(q, keys, mask, self.attn_sink, self.scaling)

    def output(self, attended: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[B, S, H, hd] -> [B, S, D]: undo the query rotation, grouped low-rank projection."""
        return output(attended, cos, sin, self.wo_a.weight, self.wo_b.weight, self.o_groups)


# The attention's per-token maths as functions of its weights: the module's methods
# call them, and so does the compiled decode step (model/runtime/compiled.py).


def queries(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wq_a: torch.Tensor, q_norm: torch.Tensor,
            wq_b: torch.Tensor, n_heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`CSA2Attention.queries`."""
    q_residual = rms_norm(F.linear(x, wq_a), q_norm, eps)
    q = F.linear(q_residual, wq_b).unflatten(-1, (n_heads, -1))
    return apply_rotary(q, cos, sin), q_residual


def indexer_query(x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  wq_b: torch.Tensor, weights_proj: torch.Tensor, n_heads: int,
                  quantize: Callable[[torch.Tensor], torch.Tensor] = INDEXER_KEY.fake_quant,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`Indexer.query`."""
    q = quantize(apply_rotary(F.linear(q_residual, wq_b).unflatten(-1, (n_heads, -1)), cos, sin))
    return q, F.linear(x, weights_proj).float() * n_heads**-0.5


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """:meth:`Indexer.score`: query heads [B, S, H, d] weighted [B, S, H] against keys
    shared [B, T, d] or per query [B, S, T, d] -> [B, S, T]."""
    pattern = "bshd,btd->bsht" if keys.ndim == 3 else "bshd,bstd->bsht"
    per_head = torch.einsum(pattern, q.float(), keys.float()).relu_() * q.shape[-1] ** -0.5
    return torch.einsum("bsht,bsh->bst", per_head, weights)


def window_raw(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wkv: torch.Tensor, kv_norm: torch.Tensor,
               eps: float) -> torch.Tensor:
    """:meth:`CSA2Attention.window_raw`."""
    return apply_rotary(rms_norm(F.linear(x, wkv), kv_norm, eps), cos, sin)


def pool_latents(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor | None, norm: torch.Tensor, ratio: int,
                 eps: float) -> torch.Tensor:
    """:class:`Compressor` as a function of its weights."""
    if wgate is None:
        return rms_norm(F.linear(x, wkv), norm, eps)
    kv = F.linear(x.float(), wkv.float()).unflatten(1, (-1, ratio))
    gate = F.linear(x.float(), wgate.float()).unflatten(1, (-1, ratio))
    latent = (kv * gate.softmax(dim=2)).sum(dim=2)
    return rms_norm(latent.to(x.dtype), norm, eps)


def index_keys_raw(latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wk: torch.Tensor, k_norm: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """:meth:`Indexer.keys_raw` as a function of its weights."""
    return apply_rotary(rms_norm(F.linear(latent, wk), k_norm, eps), cos, sin)


def attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scaling: float) -> torch.Tensor:
    """:meth:`CSA2Attention.attend`; ``keys`` may also be each query's own places
    [B, S, T, hd] (training gathers them), with ``mask`` [B, S, T] as before."""
    shared = keys.ndim == 3
    logits = torch.einsum("bshd,btd->bhst" if shared else "bshd,bstd->bhst", q.float(), keys.float()) * scaling
    probs = sink_softmax(logits.masked_fill(~mask.unsqueeze(1), float("-inf")), sink)
    return torch.einsum("bhst,btd->bshd" if shared else "bhst,bstd->bshd", probs, keys.float()).to(q.dtype)


def sink_softmax(logits: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The attention weights of masked ``logits`` [B, H, S, T] beside each head's sink
    logit (``sink`` [H]), which takes its share of the softmax and attends to nothing:
    [B, H, S, T]."""
    sink = sink.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    combined = torch.cat((logits, sink), dim=-1)
    # The shift only keeps exp in range (the softmax does not depend on it): no gradient through it.
    return torch.softmax(combined - combined.amax(dim=-1, keepdim=True).detach(), dim=-1)[..., :-1]


def attend_each(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                scaling: float) -> torch.Tensor:
    """:func:`attend` of each query over keys of its own (gathered for it: its window
    places, its picked entries): ``q`` [N, H, hd], ``keys`` [N, T, hd], ``mask`` [N, T]
    -> [N, H, hd]."""
    return attend(q[:, None], keys, mask[:, None], sink, scaling)[:, 0]


def attend_parts(q: torch.Tensor, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """:func:`attend_each` over keys given in parts, ``(keys [N, T_i, hd], mask [N, T_i])``
    each (a query's window places, its picked entries), as if concatenated along T,
    without the copy that concatenating them makes: ``q`` [N, H, hd] -> [N, H, hd].
    The same logits; the weighted sum adds the parts' shares last (equal to float
    rounding)."""
    logits = [(torch.einsum("nhd,ntd->nht", q.float(), keys.float()) * scaling).masked_fill(~mask[:, None],
                                                                                            float("-inf"))
              for keys, mask in parts]
    probs = sink_softmax(torch.cat(logits, dim=-1)[:, :, None], sink)[:, :, 0]
    shares = probs.split([keys.shape[1] for keys, _ in parts], dim=-1)
    out = torch.einsum("nht,ntd->nhd", shares[0], parts[0][0].float())
    for share, (keys, _) in zip(shares[1:], parts[1:]):
        out = out + torch.einsum("nht,ntd->nhd", share, keys.float())
    return out.to(q.dtype)


def output(attended: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor,
           o_groups: int) -> torch.Tensor:
    """:meth:`CSA2Attention.output`."""
    attended = apply_rotary(attended, cos, sin, inverse=True)
    grouped = attended.flatten(-2).unflatten(-1, (o_groups, -1))
    return F.linear(grouped_linear(grouped, wo_a, o_groups).flatten(-2), wo_b)
