"""The config loader accepts what the reference accepts and names the key of what it cannot mean."""

from __future__ import annotations

import pytest
import torch

from model.config import ConfigError, TextConfig
from model.engram_gate import EngramEmbedding
from model.loader import Checkpoint, build_modules, load_checkpoint, save_checkpoint

from tests.config_sweep import sweep_config

pytestmark = pytest.mark.unit


def _config(**changes) -> dict:
    raw = sweep_config(3)
    raw.update(changes)
    return raw


def test_released_defaults_when_the_schedule_keys_are_absent():
    config = TextConfig.from_dict({})
    assert config.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert config.kv_source_layer_ids == (2, 8, 14, 20)
    assert config.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert config.candidate_source_layer_id == 20 and config.decoder_start == 20
    # Given the released ratios but no sources: still the released sources.
    assert TextConfig.from_dict({"compress_ratios": list(config.compress_ratios)}).kv_source_layer_ids == (2, 8, 14, 20)
    # Another depth: the pattern scaled, a source at the start of each run.
    small = TextConfig.from_dict({"num_hidden_layers": 7})
    assert small.compress_ratios == (0, 0, 2, 2, 2, 1, 1) and small.kv_source_layer_ids == (2, 5)


@pytest.mark.parametrize("changes, key", [
    ({"compress_ratios": [0, 2, 2, 1, 1, 0, 0, 0, 0]}, "compress_ratios"),  # more than layers + draft layers
    ({"kv_source_layer_ids": [0], "index_source_layer_ids": [4]}, "kv_source_layer_ids"),  # a source with no indexer
    ({"swiglu_limit": None}, "swiglu_limit"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"engram_layer_ids": [9], "engram_num_embeddings": [8058]}, "engram_layer_ids"),
    ({"num_nextn_predict_layers": 1, "dspark_target_layer_ids": [7]}, "dspark_target_layer_ids"),
])
def test_illegal_configs_name_their_key(changes, key):
    with pytest.raises(ConfigError, match=key):
        TextConfig.from_dict(_config(**changes))


def test_a_layer_must_pool_at_its_sources_ratio():
    # Layer 1 (ratio 1) would read ratio-2 entries: its visibility rule would let it see
    # an entry before the entry's second token.
    raw = {**sweep_config(3), "num_hidden_layers": 3, "compress_ratios": [2, 1, 2], "kv_source_layer_ids": [0],
           "index_source_layer_ids": [0], "candidate_source_layer_id": -1, "engram_layer_ids": [1],
           "engram_num_embeddings": sweep_config(3)["engram_num_embeddings"][:1], "num_nextn_predict_layers": 0}
    with pytest.raises(ConfigError, match="compress_ratios: layer 1"):
        TextConfig.from_dict(raw)


def test_the_candidate_pool_constrains_its_own_group_only():
    raw = {**sweep_config(3), "num_hidden_layers": 4, "compress_ratios": [2, 2, 1, 1], "kv_source_layer_ids": [0, 2],
           "index_source_layer_ids": [0, 2], "candidate_source_layer_id": 0, "engram_layer_ids": [1],
           "engram_num_embeddings": sweep_config(3)["engram_num_embeddings"][:1], "num_nextn_predict_layers": 0}
    with pytest.raises(ConfigError, match="candidate_source_layer_id"):
        TextConfig.from_dict(raw)


def test_the_decoder_half_starts_at_the_last_kv_source():
    raw = {**sweep_config(3), "num_hidden_layers": 6, "compress_ratios": [0, 2, 2, 1, 1, 1],
           "kv_source_layer_ids": [1, 3, 4], "index_source_layer_ids": [1, 3, 4], "candidate_source_layer_id": 4,
           "engram_layer_ids": [5], "engram_num_embeddings": sweep_config(3)["engram_num_embeddings"][:1],
           "num_nextn_predict_layers": 0}
    config = TextConfig.from_dict(raw)
    # A replay over the tail could not build layer 4's entries: layers 3 (ratio 1) runs in the prefill.
    assert config.decoder_start == 4
    assert [p.half for p in config.layer_plans()] == ["encoder"] * 4 + ["decoder"] * 2


def test_engram_scales_have_head_dim_over_32_columns_as_released(tmp_path):
    assert EngramEmbedding(10, 16).scale.shape == (10, 0)
    assert EngramEmbedding(10, 48).scale.shape == (10, 1)
    assert EngramEmbedding(10, 64).scale.shape == (10, 2)
    # A checkpoint with 16-wide float tables (the shape the reference writes) loads and re-saves.
    from model.config import ModelConfig

    config = ModelConfig.from_dict({**_config(engram_head_dim=16), "num_nextn_predict_layers": 0})
    parts = build_modules(config)
    parts.backbone.init_weights(seed=0)
    save_checkpoint(tmp_path, Checkpoint(config, parts.backbone))
    loaded = load_checkpoint(tmp_path)
    for layer in config.text.engram_layer_ids:
        embed = loaded.backbone.layers[layer].engram.embed
        assert embed.scale.shape == (embed.num_embeddings, 0)
        assert torch.equal(embed.weight, parts.backbone.layers[layer].engram.embed.weight)


def test_a_checkpoint_without_the_drafters_tensors_loads_without_a_drafter(tmp_path):
    from model.config import ModelConfig

    config = ModelConfig.from_dict(_config(num_nextn_predict_layers=1))
    parts = build_modules(config)
    parts.backbone.init_weights(seed=0)
    save_checkpoint(tmp_path, Checkpoint(config, parts.backbone))  # as the reference saves: no mtp.* tensors
    loaded = load_checkpoint(tmp_path)
    assert loaded.drafter is None and loaded.config.text.num_nextn_predict_layers == 1
