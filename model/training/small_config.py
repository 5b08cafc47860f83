"""The small checkpoint's config: ``configs/tiny``'s structure at a larger size, over the
tokenizer of :mod:`model.training.corpus` (``v41 train-small`` trains it)."""

from __future__ import annotations

from model.engram import build_token_map
from model.engram_primes import find_primes
from model.training.corpus import BOS, EOS, IMAGE, NOISE, PAD


def small_config(tokenizer, window: int = 64) -> dict:
    """The composite config.json of the small model (configs/tiny's structure).

    10 layers: 0-1 window-only; 2-5 the ratio-2 encoder (2 Full, 3 Reuse, 4 Full, 5
    Reuse); 6-9 the ratio-1 decoder (6 Full and candidate source, 7 Reuse, 8 Reindex,
    9 Reuse). Engram at 1 and 4; MoE 8 routed top-2 + shared; one DSpark block.
    """
    token_map, compressed = build_token_map(tokenizer)
    engram_layers, engram_vocab, max_ngram, heads = [1, 4], 12000, 3, 4
    primes = find_primes(engram_vocab, len(engram_layers), max_ngram, heads)
    num_embeddings = [sum(p for per_n in layer for p in per_n) for layer in primes]
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    yarn = {"beta_fast": 32, "beta_slow": 1, "factor": 16.0, "original_max_position_embeddings": 4096}
    text = {
        "vocab_size": vocab, "hidden_size": 128, "num_hidden_layers": 10,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "q_lora_rank": 64,
        "qk_rope_head_dim": 16, "o_groups": 2, "o_lora_rank": 64,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "main": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
            "compress": {**yarn, "attention_factor": 1.0, "partial_rotary_factor": 0.25, "rope_theta": 160000.0,
                         "rope_type": "yarn"},
        },
        "rope_scaling": {**yarn, "rope_type": "yarn"},
        "max_position_embeddings": 65536,
        "sliding_window": window,
        "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0],
        "kv_source_layer_ids": [2, 4, 6],
        "index_source_layer_ids": [2, 4, 6, 8],
        "candidate_source_layer_id": 6,
        "candidate_topk_blocks": 8, "candidate_block_size": 4,
        "index_n_heads": 8, "index_head_dim": 32, "index_topk": 16,
        "moe_intermediate_size": 96, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "engram_layer_ids": engram_layers, "engram_vocab_size": engram_vocab,
        "engram_num_embeddings": num_embeddings, "engram_max_ngram_size": max_ngram,
        "engram_n_heads": heads, "engram_head_dim": 32, "engram_pad_id": PAD,
        "engram_compressed_vocab_size": compressed,
        "num_nextn_predict_layers": 1, "dspark_block_size": 5, "dspark_noise_token_id": NOISE,
        "dspark_target_layer_ids": [7, 8, 9], "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
        "initializer_range": 0.02, "rms_norm_eps": 1e-20,
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "tie_word_embeddings": False,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "image_token_id": IMAGE,
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                                "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "text_config": text,
    }
