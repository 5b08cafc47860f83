"""Seeded random V4.1 configurations across the layer plans the config language allows.

``sweep_config(seed)`` draws one small, valid text config (a flat ``config.json``
mapping) that exercises, depending on the seed:

- compress ratios 0, 1, 2 and 4, with window-only layers anywhere (first, between
  compressed layers, inside the ratio-1 decoder half, last);
- several KV sources per ratio (the release has three in its ratio-2 half), Reindex
  sources anywhere after a KV source, a candidate source or none;
- Engram on one or two layers in either half, ``engram_head_dim`` 16 (no scale
  columns, float rows) or 32;
- cache widths that block (quantised caches: ``head_dim`` 32, ``index_head_dim`` 32)
  or do not (``head_dim`` 40, ``index_head_dim`` 24: the reference and the engine keep
  those vectors in float32);
- odd and even windows, the SwiGLU clamp on or off, YaRN or plain RoPE, a drafter or not.

The tokenizer is ``configs/tiny``'s (vocabulary 2,048; 1,464 compressed ids).
"""

from __future__ import annotations

import random

from model.engram_primes import find_primes

TOKENIZER_DIR = "configs/tiny"
_ENGRAM_VOCAB, _ENGRAM_N, _ENGRAM_HEADS = 2000, 3, 2


def _ratios(rng: random.Random) -> list[int]:
    """A layer schedule: window-only lead-in, an optional pooled encoder, an optional
    ratio-1 decoder, window-only layers sprinkled in and possibly at the end."""
    lead = [0] * rng.randint(0, 2)
    encoder = [rng.choice((2, 4))] * rng.randint(0, 3)
    decoder = [1] * rng.randint(0 if encoder else 1, 3)
    body = encoder + decoder
    for _ in range(rng.randint(0, 2)):  # window-only layers inside the runs (never before a run's first layer)
        if len(body) > 1:
            body.insert(rng.randint(1, len(body) - 1), 0)
    tail = [0] * rng.choice((0, 0, 1))
    return lead + body + tail


def _sources(rng: random.Random, ratios: list[int]) -> tuple[list[int], list[int], int]:
    """KV sources (each run of a ratio starts with one; sometimes another inside the run),
    index sources (KV sources plus Reindex layers), and a candidate source or -1."""
    kv, last = [], None
    for i, r in enumerate(ratios):
        if r and r != last:
            kv.append(i)
            last = r
        elif r and r == last and rng.random() < 0.25:
            kv.append(i)
    index = sorted(set(kv) | {i for i, r in enumerate(ratios) if r and i not in kv and rng.random() < 0.4})

    def group(i: int) -> int:
        return max(s for s in kv if s <= i)

    # The candidate pool constrains later index sources of its own KV group only.
    eligible = [c for c in index if all(group(i) == group(c) for i in index if i > c)]
    candidate = rng.choice(eligible) if eligible and rng.random() < 0.7 else -1
    return kv, index, candidate


def sweep_config(seed: int) -> dict:
    """One random valid text config (flat form), reproducible from ``seed``."""
    rng = random.Random(seed)
    ratios = _ratios(rng)
    n = len(ratios)
    kv, index, candidate = _sources(rng, ratios)
    engram_layers = sorted(rng.sample(range(n), rng.choice((1, 2)) if n > 1 else 1))
    primes = find_primes(_ENGRAM_VOCAB, len(engram_layers), _ENGRAM_N, _ENGRAM_HEADS)
    blocked = rng.random() < 0.5
    head_dim, index_head_dim = (32, 32) if blocked else (40, 24)
    # A drafter reads layers that are not KV sources (the release's default targets).
    drafter = rng.random() < 0.3 and len(kv) < n
    config = {
        "vocab_size": 2048,
        "hidden_size": 48,
        "num_hidden_layers": n,
        "num_attention_heads": 2,
        "head_dim": head_dim,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "sliding_window": rng.choice((3, 5, 7, 8)),
        "compress_ratios": ratios + [0] * drafter,
        "kv_source_layer_ids": kv,
        "index_source_layer_ids": index,
        "candidate_source_layer_id": candidate,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 2,
        "index_n_heads": 2,
        "index_head_dim": index_head_dim,
        "index_topk": rng.choice((3, 4, 6)),
        "o_groups": 2,
        "o_lora_rank": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "swiglu_limit": rng.choice((0.0, 0.3, 10.0)),
        "hc_mult": rng.choice((2, 4)),
        "hc_sinkhorn_iters": 20,
        "engram_layer_ids": engram_layers,
        "engram_vocab_size": _ENGRAM_VOCAB,
        "engram_num_embeddings": [sum(p for per_n in layer for p in per_n) for layer in primes],
        "engram_max_ngram_size": _ENGRAM_N,
        "engram_n_heads": _ENGRAM_HEADS,
        "engram_head_dim": rng.choice((16, 32)),
        "engram_compressed_vocab_size": 1464,
        "num_nextn_predict_layers": int(drafter),
        "dspark_block_size": 3,
        "dspark_noise_token_id": 2047,
        "dspark_markov_rank": 8,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
        "eos_token_id": 1,
        "rms_norm_eps": 1e-6,
    }
    if rng.random() < 0.5:
        config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                                  "original_max_position_embeddings": 1024}
    return config


def features(config) -> set[str]:
    """What a config (a TextConfig) exercises, by name: the sweep's coverage."""
    plans = config.layer_plans()
    out = {f"ratio {r}" for r in config.compress_ratios}
    if any(p.has_engram and p.half == "decoder" for p in plans):
        out.add("engram in the decoder half")
    if any(p.has_engram and p.half == "encoder" for p in plans):
        out.add("engram in the encoder half")
    if len(config.engram_layer_ids) > 1:
        out.add("several engram layers")
    if plans[-1].compress_ratio == 0:
        out.add("trailing window-only layer")
    if any(p.compress_ratio == 0 and p.half == "decoder" for p in plans):
        out.add("window-only layer in the decoder half")
    if any(p.mode.value == "reindex" for p in plans):
        out.add("reindex layer")
    if any(p.candidate_source is not None for p in plans):
        out.add("candidate pool")
    if config.decoder_start == config.num_hidden_layers:
        out.add("no decoder half")
    if sum(1 for p in plans if p.is_kv_source and p.half == "encoder") > 1:
        out.add("several encoder KV sources")
    out.add(f"engram_head_dim {config.engram_head_dim}")
    out.add("quantised caches" if config.head_dim % 32 == 0 else "float caches")
    out.add(f"window {'odd' if config.sliding_window % 2 else 'even'}")
    out.add("swiglu clamp" if config.swiglu_limit > 0 else "no swiglu clamp")
    out.add("yarn" if config.rope_scaling else "no yarn")
    if config.num_nextn_predict_layers:
        out.add("drafter")
    return out
