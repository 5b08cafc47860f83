"""DSpark drafter: released names and shapes on meta, the parallel draft over a window of
injected context, the Markov head and the confidence head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from model.config import ConfigError, TextConfig
from model.dspark import DSparkDrafter

pytestmark = pytest.mark.unit

GOLDEN_CONFIG = Path(__file__).parents[1] / "golden" / "A" / "config.json"
WINDOW = 4


def _tiny_config(**overrides) -> TextConfig:
    raw = json.loads(GOLDEN_CONFIG.read_text())
    raw.update(
        num_nextn_predict_layers=2,
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
        dspark_markov_rank=8,
        sliding_window=WINDOW,
    )
    raw.update(overrides)
    return TextConfig.from_dict(raw)


class _Tiny:
    """A randomly initialised tiny drafter with the backbone's embedding and head."""

    def __init__(self, **overrides):
        torch.manual_seed(0)
        self.config = _tiny_config(**overrides)
        c = self.config
        self.drafter = DSparkDrafter(c)
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        with torch.no_grad():
            for name, p in self.drafter.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                else:
                    p.normal_(0, 0.1)
            self.embed.weight.normal_(0, 1.0)

    def streams(self, batch: int, length: int, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        c = self.config
        return torch.randn(batch, length, len(c.dspark_target_layer_ids), c.hc_mult, c.hidden_size, generator=g)

    def draft(self, streams, anchors, **kwargs):
        return self.drafter(streams, anchors, self.embed, self.head, **kwargs)


@pytest.fixture(scope="module")
def tiny() -> _Tiny:
    return _Tiny()


def test_full_drafter_has_the_released_names_and_shapes_on_meta():
    config = TextConfig.from_dict({})
    with torch.device("meta"):
        drafter = DSparkDrafter(config)
    shapes = {name: tuple(p.shape) for name, p in drafter.named_parameters()}
    per_stage = [sum(n.startswith(f"mtp.{s}.") for n in shapes) for s in range(3)]
    # 128 experts x 3 + 22 block tensors; + main_proj/main_norm on 0; + norm/markov x2/confidence on 2.
    assert per_stage == [408, 406, 410]
    assert all(n.startswith("mtp.") for n in shapes)
    d, v, r = 5120, 129280, 256
    assert shapes["mtp.0.main_proj.weight"] == (d, 3 * d)
    assert shapes["mtp.0.main_norm.weight"] == (d,)
    assert shapes["mtp.2.norm.weight"] == (d,)
    assert shapes["mtp.2.markov_head.embed.weight"] == (v, r)
    assert shapes["mtp.2.markov_head.head.weight"] == (v, r)
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, d + r)
    assert "mtp.2.confidence_head.proj.bias" not in shapes
    assert "mtp.1.main_proj.weight" not in shapes and "mtp.1.norm.weight" not in shapes
    for s in range(3):
        assert shapes[f"mtp.{s}.ffn.gate.weight"] == (128, d)
        assert shapes[f"mtp.{s}.ffn.gate.bias"] == shapes[f"mtp.{s}.ffn.gate.bias_vl"] == (128,)
        assert shapes[f"mtp.{s}.ffn.experts.127.w1.weight"] == (2304, d)
        assert shapes[f"mtp.{s}.ffn.experts.127.w2.weight"] == (d, 2304)
        assert shapes[f"mtp.{s}.ffn.shared_experts.w3.weight"] == (2304, d)
        assert shapes[f"mtp.{s}.attn.wq_a.weight"] == (1280, d)
        assert shapes[f"mtp.{s}.attn.wq_b.weight"] == (64 * 512, 1280)
        assert shapes[f"mtp.{s}.attn.wkv.weight"] == (512, d)
        assert shapes[f"mtp.{s}.attn.wo_a.weight"] == (8 * 1024, 64 * 512 // 8)
        assert shapes[f"mtp.{s}.attn.wo_b.weight"] == (d, 8 * 1024)
        assert shapes[f"mtp.{s}.attn.attn_sink"] == (64,)
        assert shapes[f"mtp.{s}.hc_attn_fn"] == (24, 4 * d)
        assert not any(".compressor." in n or ".indexer." in n or ".engram." in n for n in shapes)
    assert "mtp.0.ffn.experts.128.w1.weight" not in shapes
    assert "mtp.3.attn_norm.weight" not in shapes
    expert = 3 * d * 2304
    attn = d * 1280 + 1280 + 1280 * 64 * 512 + d * 512 + 512 + 8 * 1024 * 4096 + d * 8 * 1024 + 64
    block = 128 * expert + expert + 128 * d + 2 * 128 + attn + 2 * d + 2 * (24 * 4 * d + 24 + 3)
    expected = 3 * block + (3 * d * d + d) + d + 2 * v * r + (d + r)
    total = sum(p.numel() for p in drafter.parameters())
    assert total == expected
    assert 13.7e9 < total < 14.3e9  # 14.23B as released


def test_a_config_without_drafter_layers_is_refused():
    with pytest.raises(ConfigError):
        DSparkDrafter(_tiny_config(num_nextn_predict_layers=0))


def test_tiny_draft_shapes_and_proposal(tiny):
    c = tiny.config
    anchors = torch.tensor([5, 17])
    draft = tiny.draft(tiny.streams(2, 7), anchors)
    assert draft.hidden.shape == (2, c.dspark_block_size, c.hidden_size)
    assert draft.logits.shape == (2, c.dspark_block_size, c.vocab_size)
    assert draft.logits.dtype == torch.float32 and torch.isfinite(draft.logits).all()
    proposal = tiny.drafter.propose(draft, anchors)
    assert proposal.tokens.shape == (2, 5) and proposal.logits.shape == (2, 5, c.vocab_size)
    assert ((proposal.confidence > 0) & (proposal.confidence < 1)).all()
    assert torch.allclose(proposal.survival, proposal.confidence.cumprod(dim=-1))
    assert (proposal.survival[:, 1:] <= proposal.survival[:, :-1]).all()
    sampled = tiny.drafter.propose(draft, anchors, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert sampled.tokens.shape == (2, 5) and (sampled.tokens < c.vocab_size).all()


def test_block_inputs_are_the_anchor_then_noise(tiny):
    ids = tiny.drafter.block_ids(torch.tensor([9, 11]))
    assert ids.tolist() == [[9] + [2047] * 4, [11] + [2047] * 4]  # golden config: noise id 2047


def test_context_is_the_mean_over_the_mhc_streams(tiny):
    streams = tiny.streams(1, 6)
    anchors = torch.tensor([3])
    base = tiny.draft(streams, anchors).logits
    # Move mass between the streams, keeping each target layer's mean over them.
    shift = torch.randn(streams.shape[:-2] + (1, streams.shape[-1]))
    same_mean = streams.clone()
    same_mean[..., 0, :] += shift[..., 0, :]
    same_mean[..., 1, :] -= shift[..., 0, :]
    assert torch.allclose(tiny.draft(same_mean, anchors).logits, base, atol=1e-4)
    other_mean = streams.clone()
    other_mean[:, -1, 2, 0, :] += 1.0  # the last target layer at the last position
    assert not torch.allclose(tiny.draft(other_mean, anchors).logits, base, atol=1e-4)


def test_context_older_than_the_window_does_not_matter(tiny):
    t = 9
    streams = tiny.streams(1, t)
    anchors = torch.tensor([3])
    base = tiny.draft(streams, anchors).logits
    old = streams.clone()
    old[:, : t - WINDOW] = torch.randn_like(old[:, : t - WINDOW])  # positions before the window
    assert torch.allclose(tiny.draft(old, anchors).logits, base, atol=1e-5)
    recent = streams.clone()
    recent[:, t - WINDOW] += 2.0  # the oldest position inside the window
    assert not torch.allclose(tiny.draft(recent, anchors).logits, base, atol=1e-4)


def test_entries_at_or_after_the_anchor_are_ignored(tiny):
    t = 6
    streams = tiny.streams(1, t)
    anchors = torch.tensor([7])
    base = tiny.draft(streams, anchors).logits
    padded = torch.cat((streams, torch.randn_like(streams[:, :3])), dim=1)  # 3 later positions
    out = tiny.draft(padded, anchors, anchor_positions=torch.tensor([t])).logits
    assert torch.allclose(out, base, atol=1e-5)


def test_no_causal_mask_inside_the_block():
    tiny = _Tiny()
    streams, anchors = tiny.streams(1, 5), torch.tensor([3])
    base = tiny.draft(streams, anchors).logits
    tiny.drafter.noise_token_id = 1000  # other placeholders at positions 1..4
    changed = tiny.draft(streams, anchors).logits
    assert not torch.allclose(changed[:, 0], base[:, 0], atol=1e-4)  # the anchor sees the positions after it


def test_requests_in_a_batch_are_independent(tiny):
    streams = tiny.streams(2, 7, seed=4)
    anchors = torch.tensor([5, 8])
    batched = tiny.draft(streams, anchors).logits
    alone = tiny.draft(streams[1:], anchors[1:]).logits
    assert torch.allclose(batched[1:], alone, atol=1e-4)


def test_markov_bias_is_the_low_rank_bigram_product(tiny):
    head = tiny.drafter.markov_head
    table = head.embed.weight @ head.head.weight.T  # the V x V "what follows what" table
    prev = torch.tensor([[0, 5, 2047], [17, 17, 3]])
    assert torch.allclose(head(prev), table[prev], atol=1e-5)
    draft = tiny.draft(tiny.streams(1, 6), torch.tensor([21]))
    proposal = tiny.drafter.propose(draft, torch.tensor([21]))
    previous = [21] + proposal.tokens[0, :-1].tolist()
    for k, p in enumerate(previous):
        step = draft.logits[0, k] + table[p]
        assert torch.allclose(proposal.logits[0, k], step, atol=1e-4)
        assert proposal.tokens[0, k] == step.argmax()
    teacher = tiny.drafter.markov_logits(draft.logits, torch.tensor([previous]))
    assert torch.allclose(teacher, proposal.logits, atol=1e-5)


def test_confidence_head_reads_hidden_and_markov_embedding(tiny):
    draft = tiny.draft(tiny.streams(1, 6), torch.tensor([4]))
    proposal = tiny.drafter.propose(draft, torch.tensor([4]))
    previous = torch.tensor([[4] + proposal.tokens[0, :-1].tolist()])
    w = tiny.drafter.confidence_head.proj.weight[0]
    features = torch.cat((draft.hidden, tiny.drafter.markov_head.embed.weight[previous]), dim=-1)
    assert torch.allclose(proposal.confidence, torch.sigmoid(features @ w), atol=1e-5)
