"""Properties of the model core that hold whatever the weights are."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from model import mhc
from model.config import AttentionMode, ConfigError, ModelConfig, TextConfig
from model.engram import EngramLayout, NgramHasher
from model.transformer import Transformer

pytestmark = pytest.mark.unit


def _golden_text(golden_dir, **overrides) -> TextConfig:
    raw = json.loads((golden_dir / "config.json").read_text())
    raw.update(overrides)
    return TextConfig.from_dict(raw)


def _run(config: TextConfig, ids: torch.Tensor, seed: int = 0, std: float = 0.2):
    """Reference logits and the per-layer attention masks, on random weights."""
    model = Transformer(config).init_weights(seed, std=std).eval()
    token_map = list(range(config.vocab_size))
    layout = dataclasses.replace(EngramLayout.from_config(config))
    hasher = NgramHasher(layout, [t % config.engram_compressed_vocab_size for t in token_map])
    masks = {}
    for block in model.layers:
        original = block.attn.attend

        def spy(q, keys, mask, _layer=block.plan.index, _original=original):
            masks[_layer] = mask
            return _original(q, keys, mask)

        block.attn.attend = spy
    return model(ids, hasher.hash_ids(ids)[0]), masks


def test_sinkhorn_is_doubly_stochastic():
    logits = torch.randn(1000, 4, 4, generator=torch.Generator().manual_seed(0))
    comb = mhc.sinkhorn(logits, iters=20, eps=1e-6)
    assert (comb.sum(-2) - 1).abs().max() < 1e-5  # it ends on a column normalisation
    assert (comb.sum(-1) - 1).abs().max() < 1e-3
    assert (comb > 0).all()
    # Sharper logits converge more slowly; more iterations keep converging.
    sharp = logits * 3
    errors = [(mhc.sinkhorn(sharp, iters=n, eps=1e-6).sum(-1) - 1).abs().max() for n in (5, 20, 200)]
    assert errors[0] > errors[1] > 5 * errors[2]


def test_layer_plan_of_released_config():
    config = ModelConfig.load("configs/deepseek-v4.1-flash").text
    plans = config.layer_plans()
    modes = [p.mode for p in plans]
    assert modes[:2] == [AttentionMode.WINDOW] * 2
    assert [p.index for p in plans if p.mode is AttentionMode.FULL] == [2, 8, 14, 20]
    assert [p.index for p in plans if p.mode is AttentionMode.REINDEX] == [24, 28, 32, 36]
    assert sum(p.mode is AttentionMode.REUSE for p in plans) == 30
    assert [p.half for p in plans] == ["encoder"] * 20 + ["decoder"] * 20
    assert plans[20].is_candidate_source and plans[24].candidate_source == 20
    assert plans[23].index_source == 20 and plans[27].index_source == 24 and plans[19].kv_source == 14
    assert [p.index for p in plans if p.has_engram] == [1, 14]


def test_unknown_config_key_is_an_error(golden_dir):
    raw = json.loads((golden_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="unknown"):
        TextConfig.from_dict({**raw, "compress_ratio": 2})


def test_sparse_equals_dense_when_topk_covers_everything(golden_dir):
    """With top-k and the candidate pool larger than the context, every layer with a
    compressed branch reads every visible entry: its mask equals the dense one."""
    config = _golden_text(golden_dir, index_topk=4096, candidate_topk_blocks=4096)
    ids = torch.randint(0, config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(1))
    logits, masks = _run(config, ids)
    window = config.sliding_window
    pos = torch.arange(120)
    for plan in config.layer_plans():
        if plan.mode is AttentionMode.WINDOW:
            continue
        compressed = masks[plan.index][0, :, 120:]
        dense = torch.arange(compressed.shape[1]) < ((pos + 1) // plan.compress_ratio).unsqueeze(-1)
        assert torch.equal(compressed, dense), f"layer {plan.index}"
        local = masks[plan.index][0, :, :120]
        delta = pos.unsqueeze(-1) - pos
        assert torch.equal(local, (delta >= 0) & (delta < window))
    # And the sparse configuration really is sparse on the same prompt.
    sparse_logits, sparse_masks = _run(_golden_text(golden_dir), ids)
    assert sparse_masks[2][0, -1, 120:].sum() == config_topk(golden_dir)
    assert not torch.allclose(sparse_logits, logits)


def config_topk(golden_dir) -> int:
    return _golden_text(golden_dir).index_topk


def test_reuse_layers_read_exactly_their_sources_picks(golden_dir):
    config = _golden_text(golden_dir)
    ids = torch.randint(0, config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(2))
    _, masks = _run(config, ids)
    plans = config.layer_plans()
    for plan in plans:
        if plan.mode is AttentionMode.REUSE:
            source = plan.index_source
            assert torch.equal(masks[plan.index][..., 150:], masks[source][..., 150:]), f"layer {plan.index}"
        if plan.runs_indexer:
            per_query = masks[plan.index][..., 150:].sum(-1)
            assert per_query.max() <= config.index_topk
    # A Reindex layer picks inside the candidate pool but differs from its source.
    reindex = [p for p in plans if p.mode is AttentionMode.REINDEX][0]
    assert not torch.equal(masks[reindex.index][..., 150:], masks[reindex.kv_source][..., 150:])


def test_candidate_entries_list_the_candidate_blocks_pool():
    from model.selection import candidate_blocks, candidate_entries

    generator = torch.Generator().manual_seed(3)
    for width, block, top in ((37, 4, 3), (64, 8, 2), (9, 4, 8)):
        scores = torch.randn(50, width, generator=generator)
        n_visible = torch.randint(0, width + 1, (50,), generator=generator)
        scores = scores.masked_fill(torch.arange(width) >= n_visible[:, None], float("-inf"))
        mask = candidate_blocks(scores, n_visible, top, block)
        index, valid = candidate_entries(scores, n_visible, top, block)
        listed = torch.zeros(mask.shape, dtype=torch.int64).scatter_add_(-1, index, valid.long()) > 0
        assert torch.equal(listed, mask)


def test_top_k_takes_the_best_and_breaks_ties_toward_the_lower_index():
    """Against the definition (sort by score, then index), on scores with many ties,
    -inf entries and zeros of both signs (equal scores); the result does not depend on
    where a row's ties fall."""
    from model.selection import top_k

    generator = torch.Generator().manual_seed(0)
    for _ in range(500):
        width = int(torch.randint(1, 40, (1,), generator=generator))
        k = int(torch.randint(1, 12, (1,), generator=generator))
        scores = torch.randint(-3, 4, (3, width), generator=generator).float() / 4
        scores[scores == -0.75] = float("-inf")
        scores[(scores == 0) & (torch.rand(scores.shape, generator=generator) < 0.5)] = -0.0
        indices, values = top_k(scores, k)
        for row in range(3):
            ranked = sorted(range(width), key=lambda i: (-scores[row, i].item(), i))[: min(k, width)]
            assert indices[row].tolist() == sorted(ranked)
            assert torch.equal(values[row], scores[row, indices[row]])
