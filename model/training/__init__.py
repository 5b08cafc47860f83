"""Training math for the small checkpoint: a differentiable forward, the losses, the optimizers.

The reference forward (:meth:`model.transformer.Transformer.forward`) runs under
``no_grad`` and its fake-quantisation steps have no gradient. :func:`train_forward`
runs the same block loop (:func:`model.transformer.run_blocks`) over the same module
methods, its attention reading its keys as :class:`TrainingKeys` says, with three
differences that training needs and that leave the forward values unchanged:

- **Quantisation-aware (straight-through).** Every value the released format rounds is
  rounded in the forward and passed through unchanged in the backward
  (``x + (fq(x) - x).detach()``): dense weights FP8 (32x32 tiles), routed experts FP4,
  Engram rows FP8, window KV FP8, long-range entries FP4, indexer keys and queries FP4.
  So the forward equals the reference forward of the quantised checkpoint.
- **Selection as masks.** Indexer top-k, candidate blocks and router top-k pick
  discrete sets; no gradient flows through a pick.
- **The indexer learns from the attention, and only from it** (DeepSeek V3.2's
  lightning-indexer recipe). Its inputs (hidden state, query residual, pooled latents)
  are detached, and its loss is ``KL(target || softmax(indexer scores))`` over the
  visible long-range entries, where the target is the layer's own main attention
  (its queries against every visible entry, softmax per head, summed over heads and
  renormalised; detached). The LM loss never reaches the indexer; the KL never
  reaches the rest of the model.

Bounded replays in training (the seed: the replays are used in training): a sequence
may carry a replay start ``s``. For a decoder replay, the decoder layers' windows of
queries at positions ``>= s`` lose every key before ``s`` (what Decoder SWA Bounded
Replay does when it replays only the prompt's last window); for an encoder replay the
encoder layers' windows lose them too (Encoder SWA Bounded Replay, which is followed
by a decoder replay of the same tokens).

Optimizers: :class:`Muon` (momentum, Newton-Schulz orthogonalisation, the query
projection split per head, the grouped output projection per group, experts batched)
for the hidden matrices; AdamW for the rest (embedding, head, Engram tables at 5x the
learning rate, norms, mHC mixes, routers, sinks). The routers' selection biases are
not trained by gradient: :func:`balance_routers` applies DeepSeek's auxiliary-loss-free
update after each step.

Pure math: no file I/O (the command ``v41 train-small`` owns the corpus and the disk).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import formats
from ..attention import CSA2Attention
from ..config import AttentionMode
from ..formats import COMPRESSED_KV, ENGRAM_ROW, INDEXER_KEY, WINDOW_KV
from ..selection import select_entries, visible_entries
from ..transformer import Transformer, init_module, run_blocks

__all__ = [
    "Muon",
    "ReplayStarts",
    "TrainOutput",
    "TrainingKeys",
    "attention_target",
    "backbone_step",
    "balance_routers",
    "build_optimizers",
    "fake_quant_weight",
    "indexer_kl",
    "init_module",
    "lm_loss",
    "masked_lm_loss",
    "newton_schulz",
    "quantised_weight_names",
    "straight_through",
    "train_forward",
]


# ---------------------------------------------------------------------- straight-through rounding


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` in the forward, the identity in the backward."""
    return x + (rounded - x).detach()


def _ste(x: torch.Tensor, fmt: formats.BlockFormat) -> torch.Tensor:
    return straight_through(x, fmt.fake_quant(x.detach()))


def fake_quant_weight(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The values a weight has after a round trip through the released storage format
    (``save_checkpoint`` then ``load_checkpoint``): FP4 rows for routed experts, FP8
    32x32 tiles for other dense matrices."""
    from ..loader import stored_values  # the one rule save_checkpoint applies

    return stored_values(name, weight)


def quantised_weight_names(model: Transformer) -> list[str]:
    """Parameters of the backbone that the checkpoint stores quantised, except Engram
    tables (those are rounded per looked-up row, which is the same thing)."""
    from ..loader import _is_quantised  # the one rule save_checkpoint applies

    return [
        name for name, p in model.named_parameters()
        if _is_quantised(name, p) and ".engram.embed." not in name
    ]


# ---------------------------------------------------------------------- forward


@dataclass
class ReplayStarts:
    """Per-sequence bounded-replay starts ``[B]`` (``>= S`` means no replay).

    ``decoder``: windows of decoder layers; ``encoder``: windows of encoder layers.
    An encoder replay implies a decoder replay from the same start.
    """

    decoder: torch.Tensor
    encoder: torch.Tensor

    @classmethod
    def none(cls, batch: int, length: int, device=None) -> "ReplayStarts":
        full = torch.full((batch,), length, dtype=torch.long, device=device)
        return cls(full, full.clone())


@dataclass
class TrainOutput:
    """``logits`` [B, S, V]; ``indexer_loss`` (mean KL per query, summed over indexer
    layers); ``indexer_kl`` per indexer layer (floats); ``loads`` expert counts per layer."""

    logits: torch.Tensor
    indexer_loss: torch.Tensor
    indexer_kl: dict[int, float] = field(default_factory=dict)
    loads: dict[int, torch.Tensor] = field(default_factory=dict)


class _Forward(nn.Module):
    """Holds the model so that :func:`torch.func.functional_call` can swap in the
    straight-through rounded weights for one call."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids, engram_ids, replay: ReplayStarts, quantize: bool, quantize_rows: bool,
                image_mask=None, image_embeds=None) -> TrainOutput:
        model = self.model
        batch, length = input_ids.shape
        device = input_ids.device
        streams, pre = model.streams_of(model.input_embeddings(input_ids, image_mask, image_embeds))
        positions = torch.arange(length, device=device).expand(batch, length)
        rows = model.engram_rows(engram_ids)
        if quantize_rows:
            rows = {layer: _ste(r, ENGRAM_ROW) for layer, r in rows.items()}
        keys = TrainingKeys(model, positions, replay, quantize)
        streams, pre = run_blocks(model.layers, streams, pre, keys, rows, image_mask)
        logits = model.head(streams, pre)
        indexer_loss = torch.stack(keys.losses).sum() if keys.losses else logits.new_zeros(())
        return TrainOutput(logits, indexer_loss, keys.kls)


@dataclass
class TrainingKeys:
    """Training's :class:`~model.transformer.Keys`: the whole sequences at ``positions``
    [B, S], each query's places gathered (:func:`_attention`), straight-through rounded
    when ``quantize``, with the ``replay`` cuts of each half's windows; the long-range
    state its layers publish is ``memory``. Collects each indexer's distillation loss
    (``losses``, and ``kls`` as floats by layer)."""

    model: Transformer
    positions: torch.Tensor
    replay: ReplayStarts
    quantize: bool
    memory: dict = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    kls: dict[int, float] = field(default_factory=dict)

    def attend(self, block, x: torch.Tensor) -> torch.Tensor:
        starts = self.replay.decoder if block.plan.half == "decoder" else self.replay.encoder
        out, kl = _attention(self.model, block.attn, x, self.positions, self.memory, starts, self.quantize)
        if kl is not None:
            self.losses.append(kl)
            self.kls[block.plan.index] = float(kl.detach())
        return out


def _attention(model: Transformer, attn: CSA2Attention, x, positions, memory: dict, starts, quantize):
    """:meth:`Transformer.attention_reference` with gradients, replay masks and the
    indexer's distillation loss. Returns (output [B, S, D], KL or None).

    Attention gathers what each query may read, as the engine does (its window as a
    strided view, its picked entries by index), instead of masking a dense [S, S + T]
    score matrix: same values, a tenth of the work at these shapes.
    """
    plan, config = attn.plan, model.config
    window = config.sliding_window
    cos, sin = model.rotary[plan.rope](positions)
    q, q_residual = attn.queries(x, cos, sin)
    keys = attn.window_raw(x, cos, sin)
    keys = _ste(keys, WINDOW_KV) if quantize else keys
    # Window slot w of query p holds position p - window + 1 + w.
    padded = F.pad(keys, (0, 0, window - 1, 0))
    win_keys = padded.unfold(1, window, 1).transpose(-1, -2)  # [B, S, W, hd]
    win_pos = positions.unsqueeze(-1) + torch.arange(1 - window, 1, device=x.device)  # [B, S, W]
    s = starts.view(-1, 1, 1)
    win_valid = (win_pos >= 0) & ~((positions.unsqueeze(-1) >= s) & (win_pos < s))
    kl = None
    if plan.mode is AttentionMode.WINDOW:
        return attn.output(attn.attend(q, win_keys, win_valid), cos, sin), kl
    ratio, source = plan.compress_ratio, plan.kv_source
    if plan.mode is AttentionMode.FULL:
        entries, index_keys = attn.compress(x, positions, model.rotary["compress"])
        memory[("entries", source)] = _ste(entries, COMPRESSED_KV) if quantize else entries
        memory[("keys", source)] = _ste(index_keys, INDEXER_KEY) if quantize else index_keys
    entries = memory[("entries", source)]
    if plan.runs_indexer:
        visible = visible_entries(positions, entries.shape[1], ratio)
        index_keys = memory[("keys", source)]
        quantize_q = (lambda q: _ste(q, INDEXER_KEY)) if quantize else (lambda q: q)
        scores = attn.indexer.scores(x.detach(), q_residual.detach(), cos, sin, index_keys, quantize_q)
        with torch.no_grad():
            chosen = select_entries(scores.detach(), (positions + 1) // ratio, config.index_topk, plan, config,
                                    memory.get("candidates"))
            if chosen.pool is not None:
                memory["candidates"] = chosen.pool
            memory[("picks", plan.index)] = (chosen.index, chosen.valid)
        kl = indexer_kl(scores, attention_target(attn, q.detach(), entries.detach(), visible), visible)
    index, valid = memory[("picks", plan.index_source)]
    batch = torch.arange(entries.shape[0], device=x.device).view(-1, 1, 1)
    picked = entries[batch, index]  # [B, S, k, hd]
    out = attn.attend(q, torch.cat((win_keys, picked), dim=2), torch.cat((win_valid, valid), dim=-1))
    return attn.output(out, cos, sin), kl


@torch.no_grad()
def attention_target(attn: CSA2Attention, q: torch.Tensor, entries: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The indexer's target [B, S, T]: the main attention of every head over all visible
    long-range entries, summed over heads, renormalised (zero rows where none is visible)."""
    logits = torch.einsum("bshd,btd->bhst", q.float(), entries.float()) * attn.scaling
    logits = logits.masked_fill(~visible.unsqueeze(1), -1e30)
    probs = torch.softmax(logits, dim=-1).sum(dim=1) * visible
    return probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)


def indexer_kl(scores: torch.Tensor, target: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Mean over queries with a visible entry of ``KL(target || softmax(scores))``."""
    log_p = torch.log_softmax(scores.masked_fill(~visible, -1e30), dim=-1)
    terms = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - log_p), torch.zeros_like(target))
    rows = visible.any(-1)
    return terms.sum(-1)[rows].mean() if bool(rows.any()) else scores.sum() * 0.0


def train_forward(
    model: Transformer,
    input_ids: torch.Tensor,
    engram_ids: torch.Tensor | None = None,
    replay: ReplayStarts | None = None,
    quantize: bool = True,
    quantize_weights: bool | None = None,
    image_mask: torch.Tensor | None = None,
    image_embeds: torch.Tensor | None = None,
) -> TrainOutput:
    """The differentiable full-sequence forward (values = the reference forward of the
    quantised checkpoint when ``quantize`` and no replay). Also counts expert loads.

    ``quantize`` rounds the caches and (unless ``quantize_weights`` is False) the
    weights and Engram rows as the released format stores them, straight-through.
    ``image_mask`` [B, S] and ``image_embeds`` [n, D] as in :meth:`Transformer.forward`
    (gradients reach the embeddings: the vision tower trains through the backbone)."""
    batch, length = input_ids.shape
    if replay is None:
        replay = ReplayStarts.none(batch, length, input_ids.device)
    if model.config.engram_layer_ids and engram_ids is None:
        raise ValueError("this model has Engram layers: pass engram_ids from the NgramHasher")
    wrapper = _Forward(model)
    overrides = {}
    quantize_weights = quantize and quantize_weights is not False
    if quantize_weights:
        params = dict(model.named_parameters())
        for name in quantised_weight_names(model):
            p = params[name]
            overrides["model." + name] = straight_through(p, fake_quant_weight(name, p))
    loads: dict[int, torch.Tensor] = {}
    hooks = []
    for block in model.layers:
        def hook(module, args, output, index=block.plan.index):
            loads[index] = torch.bincount(output[1].flatten(), minlength=module.weight.shape[0])
        hooks.append(block.ffn.gate.register_forward_hook(hook))
    try:
        args = (input_ids, engram_ids, replay, quantize, quantize_weights, image_mask, image_embeds)
        out = torch.func.functional_call(wrapper, overrides, args, strict=False)
    finally:
        for h in hooks:
            h.remove()
    out.loads = loads
    return out


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())


def masked_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy weighted per position of ``input_ids`` (0: not a
    target), normalised by the weights' sum."""
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten(), reduction="none")
    weights = weights[:, 1:].flatten()
    return (losses * weights).sum() / weights.sum().clamp(min=1)


# ---------------------------------------------------------------------- init, balancing


@torch.no_grad()
def balance_routers(model: Transformer, loads: dict[int, torch.Tensor], gamma: float) -> float:
    """DeepSeek's auxiliary-loss-free balancing: ``bias += gamma * sign(mean load - load)``
    per layer (text bias; this corpus has no images). Returns the mean over layers of
    max load / mean load (1.0 = perfectly balanced)."""
    imbalance = []
    for block in model.layers:
        load = loads.get(block.plan.index)
        if load is None:
            continue
        load = load.float()
        block.ffn.gate.bias.add_(gamma * torch.sign(load.mean() - load))
        imbalance.append(float(load.max() / load.mean().clamp_min(1e-9)))
    return sum(imbalance) / max(1, len(imbalance))


# ---------------------------------------------------------------------- optimizers


def backbone_step(model: Transformer, optimizers: list[torch.optim.Optimizer], loss: torch.Tensor,
                  loads: dict[int, torch.Tensor], clip: float = 1.0, gamma: float = 1e-3) -> None:
    """One update of a backbone: backward, gradient norm clipped to ``clip``, every
    optimizer stepped, then the routers balanced by the step's expert ``loads``."""
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
    for opt in optimizers:
        opt.step()
    balance_routers(model, loads, gamma=gamma)


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximate orthogonalisation ``U V^T`` of ``g`` [..., m, n] (Muon's quintic iteration)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = x.transpose(-2, -1)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        m = x @ x.transpose(-2, -1)
        x = a * x + (b * m + c * m @ m) @ x
    return x.transpose(-2, -1) if transpose else x


class Muon(torch.optim.Optimizer):
    """Momentum + Newton-Schulz orthogonalisation, for 2-D hidden matrices.

    Each parameter may be split into equal row blocks (``split``: the query projection
    per head, the grouped output projection per group) orthogonalised separately.
    Parameters of equal shape are orthogonalised as one batch (the experts). The update
    is scaled by ``0.2 * sqrt(max(m, n))`` so its RMS matches AdamW's and the two share
    learning rates; decoupled weight decay.
    """

    def __init__(self, params: Iterable[dict], lr: float = 3e-3, momentum: float = 0.95, weight_decay: float = 0.0,
                 ns_steps: int = 5):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps, split=1))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                buf = state["momentum"]
                buf.mul_(mu).add_(p.grad)
                update = p.grad.add(buf, alpha=mu)  # Nesterov
                update = update.view(group["split"], -1, update.shape[-1])
                buckets.setdefault(tuple(update.shape), []).append((p, update))
            for shape, items in buckets.items():
                ortho = newton_schulz(torch.stack([u for _, u in items]), group["ns_steps"])
                scale = 0.2 * math.sqrt(max(shape[-2], shape[-1]))
                for (p, _), o in zip(items, ortho):
                    if wd:
                        p.mul_(1 - lr * wd)
                    p.add_(o.view_as(p), alpha=-lr * scale)


def _muon_split(name: str, param: torch.Tensor, model: Transformer) -> int | None:
    """Row blocks for Muon, or None when the parameter belongs to AdamW."""
    config = model.config
    if param.ndim != 2 or not name.startswith("layers."):
        return None
    if ".engram.embed." in name or ".gate.weight" in name or "hc_" in name or "norm" in name:
        return None
    if name.endswith("attn.wq_b.weight"):
        return config.num_attention_heads
    if name.endswith("indexer.wq_b.weight"):
        return config.index_n_heads
    if name.endswith("attn.wo_a.weight"):
        return config.o_groups
    return 1


def build_optimizers(model: Transformer, lr: float, weight_decay: float = 0.01, engram_lr_mult: float = 5.0,
                     muon: bool = True) -> list[torch.optim.Optimizer]:
    """Muon for the hidden matrices, AdamW for the rest (each group records its
    ``base_lr`` so a schedule can scale it). Router biases are left out: they move by
    :func:`balance_routers` only."""
    muon_groups: dict[int, list] = {}
    adam = {"decay": [], "no_decay": [], "engram": []}
    for name, p in model.named_parameters():
        if name.endswith((".gate.bias", ".gate.bias_vl")) or name.endswith(".engram.embed.scale"):
            p.requires_grad_(False)
            continue
        split = _muon_split(name, p, model) if muon else None
        if split is not None:
            muon_groups.setdefault(split, []).append(p)
        elif ".engram.embed." in name:
            adam["engram"].append(p)
        elif p.ndim == 2:
            adam["decay"].append(p)
        else:
            adam["no_decay"].append(p)
    optimizers: list[torch.optim.Optimizer] = []
    if muon_groups:
        optimizers.append(Muon(
            [{"params": ps, "split": s, "base_lr": lr} for s, ps in sorted(muon_groups.items())],
            lr=lr, weight_decay=weight_decay,
        ))
    groups = [
        {"params": adam["decay"], "weight_decay": weight_decay, "base_lr": lr},
        {"params": adam["no_decay"], "weight_decay": 0.0, "base_lr": lr},
        {"params": adam["engram"], "weight_decay": 0.0, "base_lr": lr * engram_lr_mult},
    ]
    groups = [g for g in groups if g["params"]]
    for g in groups:
        g["lr"] = g["base_lr"]
    optimizers.append(torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8))
    return optimizers
