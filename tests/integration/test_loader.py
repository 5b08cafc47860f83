"""Checkpoint I/O: released names and formats, quantised round trips, strictness."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import formats
from model.checkpoint_files import CheckpointError
from model.config import ModelConfig, TextConfig, VisionConfig
from model.loader import build_modules, load_checkpoint, load_model, save_checkpoint

pytestmark = pytest.mark.integration


def _tiny_full_config(golden_dir) -> ModelConfig:
    """The golden text config plus one DSpark layer and a two-layer vision tower."""
    raw = json.loads((golden_dir / "config.json").read_text())
    raw.update(num_nextn_predict_layers=1, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
               dspark_markov_rank=16)
    vision = VisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    return ModelConfig(text=TextConfig.from_dict(raw), vision=vision)


def test_quantised_round_trip_of_every_part(tmp_path, golden_dir):
    config = _tiny_full_config(golden_dir)
    parts = build_modules(config)
    torch.manual_seed(0)
    for module in (parts.backbone, parts.drafter, parts.vision):
        for param in module.parameters():
            param.data.normal_(0, 0.05)
    save_checkpoint(tmp_path, parts, quantize=True)
    stored = load_file(tmp_path / "model.safetensors")
    # Released names and storage dtypes.
    assert stored["layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.2.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.0.ffn.experts.3.w1.weight"].dtype == torch.int8
    assert stored["layers.1.engram.embed.weight"].dtype == torch.float8_e4m3fn
    assert "head.weight" in stored and "mtp.0.main_proj.weight" in stored and "image_newline" in stored
    loaded = load_checkpoint(tmp_path)
    # Each dequantised tensor equals its format's quantise-dequantise of the original.
    original = dict(parts.backbone.named_parameters())
    reloaded = dict(loaded.backbone.named_parameters())
    w = original["layers.2.attn.wq_a.weight"].detach()
    assert torch.equal(reloaded["layers.2.attn.wq_a.weight"], formats.dequantize_fp8_weight(*formats.quantize_fp8_weight(w)))
    e = original["layers.0.ffn.experts.3.w1.weight"].detach()
    assert torch.equal(reloaded["layers.0.ffn.experts.3.w1.weight"], formats.EXPERT_FP4.fake_quant(e))
    rows = original["layers.1.engram.embed.weight"].detach()
    assert torch.equal(reloaded["layers.1.engram.embed.weight"], formats.ENGRAM_ROW.fake_quant(rows))
    assert torch.equal(reloaded["layers.0.attn.attn_sink"], original["layers.0.attn.attn_sink"])
    for name, param in loaded.drafter.named_parameters():
        if not name.endswith(".weight") or param.ndim != 2:
            assert torch.equal(param, dict(parts.drafter.named_parameters())[name]), name


def test_sharded_checkpoint_with_deepseek_names(tmp_path, golden_dir, golden_model):
    """The golden checkpoint re-saved as two shards + index, in DeepSeek's naming."""
    tensors = load_file(golden_dir / "model.safetensors")
    renamed = {("head" + k[len("lm_head"):]) if k.startswith("lm_head") else k.removeprefix("model."): v
               for k, v in tensors.items()}
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: renamed[k] for k in keys}, tmp_path / file)
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(golden_dir / "config.json", tmp_path)
    _, model = load_model(tmp_path)
    _, reference = golden_model
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def test_missing_and_unexpected_tensors_are_errors(tmp_path, golden_dir):
    tensors = load_file(golden_dir / "model.safetensors")
    shutil.copy(golden_dir / "config.json", tmp_path)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.3.attn.wq_a.weight"}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        load_model(tmp_path)
    save_file({**tensors, "model.layers.3.attn.extra": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected"):
        load_model(tmp_path)
    bad = dict(tensors)
    bad["model.layers.3.attn.wq_a.weight"] = torch.zeros(3, 3)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="shape"):
        load_model(tmp_path)


def test_every_rotary_table_is_rebuilt_on_load():
    """Rotary tables are buffers that no checkpoint stores: after loading, the backbone's
    and the drafter's equal the frequencies their config gives (not uninitialised memory)."""
    from pathlib import Path

    from model.rope import Rotary, inv_frequencies

    checkpoint = load_checkpoint(Path(__file__).resolve().parents[2] / "configs" / "small")
    tables = [(name, module) for part in (checkpoint.backbone, checkpoint.drafter)
              for name, module in part.named_modules() if isinstance(module, Rotary)]
    assert len(tables) == 3  # main and compress for the backbone, main for the drafter
    for name, rotary in tables:
        assert torch.equal(rotary.inv_freq, inv_frequencies(rotary.spec, rotary.rope_dim)), name
