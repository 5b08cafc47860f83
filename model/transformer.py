"""The V4.1 backbone, top to bottom, and its reference full-sequence forward.

token ids -> embedding copied into ``hc_mult`` streams -> 40 blocks (Engram write at
its layers, then attention and MoE, each wrapped in mHC) -> collapse -> norm ->
output head. The first half of the blocks is the causal encoder, the second the
decoder whose long-range memory is projected from the encoder's output (the CED
source layer's compressor reads its own input, which is the encoder's output).

:meth:`Transformer.forward` is the plain reference: every layer over every token,
fp32, dense masks. It is the oracle the engine's cached paths are tested against.

Every path runs the blocks through one loop, :func:`run_blocks`: the reference,
training, the engine and the DSpark drafter differ only in where attention reads its
keys (a :class:`Keys`) and what they tap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
from torch import nn

from . import mhc
from .attention import CSA2Attention
from .config import AttentionMode, LayerPlan, TextConfig
from .engram_gate import EngramGate
from .formats import COMPRESSED_KV, INDEXER_KEY
from .moe import MoE
from .norm import RMSNorm
from .rope import Rotary
from .selection import select_entries, window_mask


@torch.no_grad()
def init_module(module: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Random initialisation of any V4.1 module (backbone, drafter): matrices and tables
    ~ N(0, std); norms and scales 1; biases, mHC bases and sinks 0."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name or leaf in ("q_weight", "k_weight", "scale") or leaf.endswith("_scale"):
            param.fill_(1.0)
        elif leaf in ("bias", "bias_vl", "attn_sink") or leaf.endswith("_base"):
            param.zero_()
        else:
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    return module


class Block(nn.Module):
    """One backbone layer: optional Engram write, attention and MoE under mHC."""

    def __init__(self, config: TextConfig, plan: LayerPlan):
        super().__init__()
        self.plan = plan
        self.hc_iters, self.hc_eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.attn = CSA2Attention(config, plan)
        self.ffn = MoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.swiglu_limit,
            config.scoring_func,
            config.gate_temp,
            config.norm_topk_prob,
            config.routed_scaling_factor,
        )
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.engram = EngramGate.from_config(config, plan.index) if plan.has_engram else None
        self.engram_table = config.engram_layer_ids.index(plan.index) if plan.has_engram else None
        hc, mix = config.hc_mult, (2 + config.hc_mult) * config.hc_mult
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, hc * config.hidden_size)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor],
                engram_rows: torch.Tensor | None = None, image_mask: torch.Tensor | None = None):
        """The layer: the Engram write (``engram_rows`` [..., cols, hd]; image tokens
        keep their streams), attention and MoE, each under mHC. Returns (streams, the
        ``pre`` mix for the next site).

        ``attend(x)`` maps the normalised attention input [..., D] to the attention
        output [..., D]; where it reads its keys is the caller's (:class:`Keys`).
        """
        if self.engram is not None:
            streams = self.engram(streams, engram_rows, None if image_mask is None else ~image_mask)
        attn_pre, attn_post, attn_comb = self.mixes(streams, "attn")
        out = attend(self.attn_norm(mhc.collapse(streams, pre)))
        streams = mhc.expand(out, streams, attn_post, attn_comb)
        return self.ffn_sublayer(streams, attn_pre, image_mask)

    def mixes(self, streams: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre, post, comb) of the ``attn`` or ``ffn`` site for ``streams`` [B, S, hc, D]."""
        fn, base, scale = (getattr(self, f"hc_{site}_{name}") for name in ("fn", "base", "scale"))
        return mhc.hc_mixes(streams, fn, scale, base, self.hc_iters, self.hc_eps, self.norm_eps)

    def ffn_sublayer(self, streams: torch.Tensor, attn_pre: torch.Tensor, image_mask: torch.Tensor | None):
        """The MoE half of the block: returns (streams, the ``pre`` for the next site)."""
        ffn_pre, ffn_post, ffn_comb = self.mixes(streams, "ffn")
        x = self.ffn_norm(mhc.collapse(streams, attn_pre))
        mask = image_mask.reshape(-1) if image_mask is not None else None
        return mhc.expand(self.ffn(x, mask), streams, ffn_post, ffn_comb), ffn_pre


class Keys(Protocol):
    """Where a layer's attention reads its keys: the one thing the paths through the
    blocks differ in. The reference reads the whole sequence with dense masks
    (:class:`FullSequence`), training the same sequence gathered and differentiable
    (:class:`model.training.TrainingKeys`), the engine each sequence's byte caches
    (:class:`model.runtime.gather.CachedKeys`), the DSpark drafter its context
    window (:class:`model.dspark.DraftKeys`)."""

    def attend(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        """``block``'s attention of its normalised input ``x`` [..., D] -> [..., D]."""


@dataclass
class Tap:
    """Collects the residual streams entering some layers during a pass.

    ``layers`` are backbone layer indices (the DSpark targets); after a pass given this
    tap (:func:`run_blocks`: the reference forward, or the engine's ``replay``,
    ``decode`` and ``verify``), ``streams[i]`` holds the streams [..., hc, D] entering
    layer ``i`` (the engine's: [N, hc, D] for the step's flat batch, sequences in batch
    order, each sequence's tokens in order).
    """

    layers: tuple[int, ...]
    streams: dict[int, torch.Tensor] = field(default_factory=dict)

    def features(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows ``[lo, hi)`` of every tapped layer's streams, stacked in the order of
        ``layers``: [n, len(layers), hc, D] (the engine's), [B, S, len(layers), hc, D]
        (the reference forward's, all rows)."""
        return torch.stack([self.streams[i][lo:hi] for i in self.layers], dim=-3)


EngramRows = Mapping[int, torch.Tensor] | Callable[[], Mapping[int, torch.Tensor]]
"""Engram rows [..., cols, hd] by layer, or a thunk that returns them (called when the
first Engram layer is reached: a remote table service's rows arrive late)."""


def run_blocks(blocks: Iterable[Block], streams: torch.Tensor, pre: torch.Tensor, keys: Keys,
               rows: EngramRows | None = None, image_mask: torch.Tensor | None = None, tap: Tap | None = None,
               run_block: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block loop of every path: ``blocks`` in order over ``streams`` [..., hc, D]
    with the first site's ``pre`` [..., hc]; returns (streams, the next ``pre``).

    ``keys`` says where attention reads its keys; ``rows`` the Engram layers' rows;
    ``image_mask`` [...] the image positions (None: none); ``tap`` records the streams
    entering its layers. ``run_block`` (a :class:`model.runtime.compiled.CompiledBlocks`)
    runs each block, reading ``keys``, in place of :meth:`Block.forward` (no image positions).
    """
    for block in blocks:
        index = block.plan.index
        if tap is not None and index in tap.layers:
            tap.streams[index] = streams
        if run_block is not None:
            streams, pre = run_block(block, streams, pre, keys, engram_rows_of(block, rows))
        else:
            streams, pre = block(streams, pre, partial(keys.attend, block), engram_rows_of(block, rows), image_mask)
    return streams, pre


def engram_rows_of(block: Block, rows: EngramRows | None) -> torch.Tensor | None:
    """``block``'s Engram rows from ``rows`` (None for a block without Engram)."""
    if block.engram is None:
        return None
    return (rows() if callable(rows) else rows)[block.plan.index]


@dataclass
class SequenceMemory:
    """Long-range state one forward publishes to later layers of the same KV group.

    ``entries`` [B, T, hd] and ``keys`` [B, T, d] come from the group's Full layer;
    ``candidates`` [B, S, T] from the candidate source; ``picks`` [B, S, T] bool from
    the last indexer.
    """

    entries: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None
    picks: dict[int, torch.Tensor] = field(default_factory=dict)


class Transformer(nn.Module):
    """The backbone. Parameter names match the released checkpoint minus ``model.``."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.plans = config.layer_plans()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, plan) for plan in self.plans)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = nn.ModuleDict(
            {kind: Rotary(config.rope_spec(kind), config.qk_rope_head_dim) for kind in ("main", "compress")}
        )

    @property
    def encoder_only(self) -> bool:
        """Whether :meth:`keep_encoder_only` dropped the decoder half (and the head)."""
        return self.lm_head is None

    def keep_encoder_only(self) -> "Transformer":
        """Drop what a prefill replica never runs: the decoder blocks (but the CED
        projection: the decoder KV source's input norm, compressor and indexer keys)
        and the output head. The model then only serves :meth:`Engine.prefill`."""
        start = self.config.decoder_start
        for index in range(start, len(self.layers)):
            block = self.layers[index]
            if index == start and block.plan.is_kv_source:
                block.ffn = None
                for name in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b"):
                    setattr(block.attn, name, None)
            else:
                self.layers[index] = nn.Identity()
        self.lm_head = None
        return self

    @torch.no_grad()
    def init_weights(self, seed: int, std: float | None = None) -> "Transformer":
        """Random initialisation (tests, training from scratch): matrices and tables
        ~ N(0, std), norms and mHC scales 1, biases, mHC bases and sinks 0."""
        init_module(self, seed, self.config.initializer_range if std is None else std)
        return self

    # ------------------------------------------------------------------ reference
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        engram_ids: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        tap: Tap | None = None,
    ) -> torch.Tensor:
        """Reference logits [B, S, V] for ``input_ids`` [B, S] starting at position 0.

        ``engram_ids`` [B, S, n_engram_layers, cols] are the Engram row ids of every
        position (:class:`model.engram.NgramHasher`); required when the model has
        Engram layers. ``image_mask`` [B, S] marks image tokens (router bias, Engram off);
        ``image_embeds`` [n, D] are their input embeddings (the image spans, in order),
        in place of the image token's embedding. ``tap`` records the streams [B, S, hc, D]
        entering its layers.
        """
        streams, pre = self.streams_of(self.input_embeddings(input_ids, image_mask, image_embeds))
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        keys = FullSequence(self, positions, SequenceMemory())
        streams, pre = run_blocks(self.layers, streams, pre, keys, self.engram_rows(engram_ids), image_mask, tap)
        return self.head(streams, pre)

    def engram_rows(self, engram_ids: torch.Tensor | None, layers: tuple[int, ...] | None = None) -> dict[int, torch.Tensor]:
        """Rows [B, S, cols, head_dim] per Engram layer (of ``layers``, default all), fetched
        from the in-process tables."""
        blocks = [b for b in self.layers if getattr(b, "engram", None) is not None
                  and (layers is None or b.plan.index in layers)]
        if blocks and engram_ids is None:
            raise ValueError("this model has Engram layers: pass engram_ids from the NgramHasher")
        return {b.plan.index: b.engram.lookup(engram_ids[:, :, b.engram_table]) for b in blocks}

    def embed_streams(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, S] -> (streams [B, S, hc, D], the first site's one-hot ``pre``)."""
        return self.streams_of(self.embed(input_ids))

    def input_embeddings(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None,
                         image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """[..., D]: the token table's rows, and ``image_embeds`` [n, D] (the image spans,
        in order) where ``image_mask`` is set."""
        x = self.embed(input_ids)
        if image_embeds is not None:
            x = x.masked_scatter(image_mask.unsqueeze(-1), image_embeds.to(x.dtype))
        return x

    def streams_of(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embeddings [..., D] (token embeddings, image spans) -> (streams [..., hc, D],
        the first site's one-hot ``pre``): copied into every stream."""
        streams = x.unsqueeze(-2).expand(*x.shape[:-1], self.config.hc_mult, x.shape[-1]).contiguous()
        return streams, mhc.first_pre(streams)

    def head(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Final collapse, norm and output head: -> logits [B, S, V] (fp32)."""
        return self.lm_head(self.norm(mhc.collapse(streams, pre))).float()

    def attention_reference(self, attn: CSA2Attention, x: torch.Tensor, positions: torch.Tensor, memory: SequenceMemory):
        """Attention of one layer over whole sequences [B, S, D] with dense masks."""
        plan, config = attn.plan, self.config
        cos, sin = self.rotary[plan.rope](positions)
        q, q_residual = attn.queries(x, cos, sin)
        keys = attn.window_entries(x, cos, sin)
        mask = window_mask(positions, positions, config.sliding_window)
        if plan.mode is not AttentionMode.WINDOW:
            source = plan.kv_source
            if plan.mode is AttentionMode.FULL:
                entries, index_keys = attn.compress(x, positions, self.rotary["compress"])
                memory.entries[source] = COMPRESSED_KV.fake_quant(entries)
                memory.keys[source] = INDEXER_KEY.fake_quant(index_keys)
            entries = memory.entries[source]
            if plan.runs_indexer:
                scores = attn.indexer.scores(x, q_residual, cos, sin, memory.keys[source])
                chosen = select_entries(scores, (positions + 1) // plan.compress_ratio, config.index_topk, plan, config,
                                        memory.candidates)
                if chosen.pool is not None:
                    memory.candidates = chosen.pool
                memory.picks[plan.index] = chosen.mask(entries.shape[1])
            keys = torch.cat((keys, entries), dim=1)
            mask = torch.cat((mask, memory.picks[plan.index_source]), dim=-1)
        return attn.output(attn.attend(q, keys, mask), cos, sin)


@dataclass
class FullSequence:
    """The reference's :class:`Keys`: every layer reads the whole sequences at
    ``positions`` [B, S] (from 0) with dense masks; the long-range state its layers
    publish to later ones is ``memory``."""

    model: Transformer
    positions: torch.Tensor
    memory: SequenceMemory

    def attend(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        return self.model.attention_reference(block.attn, x, self.positions, self.memory)
