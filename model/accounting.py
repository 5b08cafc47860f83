"""Parameter and byte accounting of a configuration, from the model built on ``meta``.

Nothing is allocated: the modules are built on PyTorch's meta device and counted
by name. Categories follow the seed's breakdown; "backbone" is everything a token
can flow through in the layers (experts, attention, embeddings, mHC, Engram
projections), without the Engram tables, the drafter and the vision tower.

Checkpoint bytes follow the released ``quantization_config``: routed experts FP4
with a UE8M0 scale per 32 values, Engram rows FP8 with a UE8M0 scale per 32, other
2-D projection matrices FP8 with a UE8M0 scale per 32x32 tile, and the rest
(embeddings, head, routers, norms, mHC, sinks, biases) in BF16, or FP32 where the
release keeps FP32.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from . import formats
from .config import ModelConfig, TextConfig

CATEGORIES = (
    "routed_experts",
    "shared_experts",
    "attention",
    "indexers",
    "routers",
    "embeddings_and_head",
    "engram_tables",
    "engram_projections",
    "mhc",
    "norms",
    "drafter",
    "vision",
)

# Tensors the release stores in FP32 (everything else that is not quantised is BF16).
_FP32_SUFFIXES = ("attn_sink", ".bias", ".bias_vl", "hc_attn_fn", "hc_attn_base", "hc_attn_scale",
                  "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale")


@dataclass(frozen=True)
class ParamReport:
    """What ``v41 params`` prints. All counts are numbers of parameters."""

    categories: dict[str, int]
    total: int
    backbone: int
    engram: int
    active_per_output_token: int
    active_per_prompt_token: int
    checkpoint_bytes: int
    kv_bytes_per_token: int

    def as_dict(self) -> dict:
        return {
            "total": self.total,
            "backbone": self.backbone,
            "engram": self.engram,
            "active_per_output_token": self.active_per_output_token,
            "active_per_prompt_token": self.active_per_prompt_token,
            "checkpoint_bytes": self.checkpoint_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "categories": dict(self.categories),
        }


def category(name: str) -> str:
    """The accounting category of a backbone parameter name."""
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".ffn.shared_experts." in name:
        return "shared_experts"
    if ".ffn.gate." in name:
        return "routers"
    if ".attn.indexer." in name:
        return "indexers"
    if ".engram.embed." in name:
        return "engram_tables"
    if ".engram." in name:
        return "engram_projections"
    if ".attn." in name:
        return "norms" if name.endswith("norm.weight") else "attention"
    if ".hc_" in name:
        return "mhc"
    if name.startswith(("embed.", "lm_head.")):
        return "embeddings_and_head"
    return "norms"


def kv_bytes_per_token(config: TextConfig) -> int:
    """Long-range cache bytes one token leaves: per KV-source layer, its compressed
    entry (FP4, E4M3 scale per 16) and its indexer key (FP4, UE8M0 per 32), divided
    by the layer's pooling ratio. Exact for the released config: 890."""
    total = 0.0
    for plan in config.layer_plans():
        if plan.is_kv_source:
            entry = (formats.COMPRESSED_KV.for_width(config.head_dim).nbytes(config.head_dim)
                     + formats.INDEXER_KEY.for_width(config.index_head_dim).nbytes(config.index_head_dim))
            total += entry / plan.compress_ratio
    if total != int(total):
        raise ValueError(f"fractional cache bytes per token: {total}")
    return int(total)


def _stored_bytes(name: str, shape: torch.Size) -> int:
    n = shape.numel()
    if name.endswith(_FP32_SUFFIXES):
        return 4 * n
    is_matrix = name.endswith(".weight") and len(shape) == 2
    if category(name) == "routed_experts" or (".experts." in name and ".shared_experts." not in name):
        return formats.EXPERT_FP4.nbytes(n)
    if name.endswith(".engram.embed.weight"):
        return formats.ENGRAM_ROW.nbytes(n)
    high_precision = name.startswith(("embed.", "lm_head.")) or ".gate.weight" in name or "norm" in name
    if is_matrix and not high_precision:
        tiles = -(-shape[0] // 32) * -(-shape[1] // 32)
        return n + tiles  # one E4M3 byte per value, one UE8M0 byte per 32x32 tile
    return 2 * n


def count(config: ModelConfig, extra: dict[str, nn.Module] | None = None) -> ParamReport:
    """Count the backbone (plus ``extra`` modules, e.g. drafter and vision, each its
    own category) built on the meta device."""
    from .transformer import Transformer

    text = config.text
    with torch.device("meta"):
        backbone = Transformer(text)
    per_category: Counter = Counter()
    checkpoint = 0
    per_layer_active = Counter()  # (layer, category) -> params
    for name, param in backbone.named_parameters():
        if name.endswith(".engram.embed.scale"):
            checkpoint += 0  # quantisation scales are counted with their rows
            continue
        cat = category(name)
        per_category[cat] += param.numel()
        checkpoint += _stored_bytes(name, param.shape)
        if name.startswith("layers."):
            per_layer_active[(int(name.split(".")[1]), cat)] += param.numel()
    for label, module in (extra or {}).items():
        for name, param in module.named_parameters():
            per_category[label] += param.numel()
            checkpoint += _stored_bytes(name, param.shape)
    engram = per_category["engram_tables"]
    total = sum(per_category.values())
    backbone_total = total - engram - sum(per_category[label] for label in (extra or {}))

    routed_share = text.num_experts_per_tok / text.n_routed_experts
    engram_rows_read = (text.engram_max_ngram_size - 1) * text.engram_n_heads * text.engram_head_dim

    def layer_active(layer: int, cats: tuple[str, ...]) -> float:
        active = 0.0
        for cat in cats:
            n = per_layer_active[(layer, cat)]
            active += n * routed_share if cat == "routed_experts" else n
        return active

    all_cats = tuple(c for c in CATEGORIES if c != "engram_tables")
    plans = text.layer_plans()
    embed_row = text.hidden_size
    head = text.vocab_size * text.hidden_size
    output = embed_row + head + sum(layer_active(p.index, all_cats) for p in plans)
    output += engram_rows_read * len(text.engram_layer_ids)
    prompt = embed_row + sum(layer_active(p.index, all_cats) for p in plans if p.half == "encoder")
    prompt += engram_rows_read * sum(1 for p in plans if p.has_engram and p.half == "encoder")
    # The CED projection: the decoder's KV source builds its entries and indexer keys
    # from the encoder output for every prompt token.
    for p in plans:
        if p.half == "decoder" and p.is_kv_source:
            block = backbone.layers[p.index]
            prompt += sum(x.numel() for x in block.attn.compressor.parameters())
            prompt += block.attn.indexer.wk.weight.numel() + block.attn.indexer.k_norm.weight.numel()
            prompt += block.attn_norm.weight.numel() + block.hc_ffn_fn.numel() * 0
    return ParamReport(
        categories={c: per_category[c] for c in CATEGORIES if c in per_category},
        total=total,
        backbone=backbone_total,
        engram=engram,
        active_per_output_token=int(output),
        active_per_prompt_token=int(prompt),
        checkpoint_bytes=checkpoint,
        kv_bytes_per_token=kv_bytes_per_token(text),
    )
