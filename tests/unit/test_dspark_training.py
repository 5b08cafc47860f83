"""Training the DSpark drafter on a frozen backbone: the captured target streams, the
teacher-forced blocks, the paper's losses, and that a few steps learn."""

from __future__ import annotations

import pytest
import torch

from model.dspark import DSparkDrafter, draft_loss, target_streams
from model.runtime.engine import Engine
from model.transformer import Tap
from model.training import init_module

pytestmark = pytest.mark.unit

TINY = "configs/tiny"


@pytest.fixture(scope="module")
def tiny(tiny_backbone):
    return tiny_backbone


def test_target_streams_are_the_reference_forward_and_the_engine_tap(tiny):
    config, model, hasher = tiny
    ids = torch.randint(3, 2000, (1, 40), generator=torch.Generator().manual_seed(0))
    engram = hasher.hash_ids(ids)[0]
    logits, streams = target_streams(model, ids, engram, config.dspark_target_layer_ids)
    assert torch.allclose(logits, model(ids, engram), atol=1e-5)
    assert streams.shape == (1, 40, 3, config.hc_mult, config.hidden_size)
    # The engine's tap records the same streams while decoding (exact replay, then a step).
    engine = Engine(model, hasher, bounded_replay=False)
    cache = engine.new_cache()
    tap = Tap(tuple(config.dspark_target_layer_ids))
    engine.replay(cache, engine.prefill(cache, ids[0, :36].tolist()), tap=tap)
    assert torch.allclose(tap.features(), streams[0, :36], atol=1e-3)
    step = Tap(tuple(config.dspark_target_layer_ids))
    engine.decode([(cache, ids[0, 36:].tolist())], tap=step)
    assert torch.allclose(step.features(), streams[0, 36:], atol=1e-3)


def test_loss_terms_follow_the_paper():
    g = torch.Generator().manual_seed(0)
    n, k, v = 6, 5, 11
    target = torch.randn(n, k, v, generator=g)
    ids = target.argmax(-1)
    conf = torch.zeros(n, k)
    same = draft_loss(target.clone(), conf, target, ids)
    assert same.tv.abs() < 1e-6 and torch.allclose(same.acceptance, torch.ones(k))
    assert same.argmax_match.eq(1).all()
    # Confidence BCE against c* = 1 at logit 0 is log 2 per position.
    assert torch.isclose(same.conf, torch.tensor(0.6931), atol=1e-3)
    other = draft_loss(torch.randn(n, k, v, generator=g), conf, target, ids)
    assert other.tv > 0.1 and (other.acceptance < 1).all()
    assert torch.isclose(other.total, 0.1 * other.ce + 0.9 * other.tv + 1.0 * other.conf)
    # Earlier positions weigh more: an error at position 0 costs more than the same error at the last.
    first, last = target.clone(), target.clone()
    first[:, 0] = -first[:, 0]
    last[:, -1] = -last[:, -1]
    assert draft_loss(first, conf, target, ids).tv > draft_loss(last, conf, target, ids).tv


def test_teacher_forced_blocks_match_the_inference_draft_and_train(tiny):
    config, model, hasher = tiny
    model.requires_grad_(False)  # frozen, as in `v41 train-drafter`: embed and head are shared
    drafter = init_module(DSparkDrafter(config), seed=1, std=0.08)
    ids = torch.randint(3, 2000, (2, 48), generator=torch.Generator().manual_seed(1))
    teacher, streams = target_streams(model, ids, hasher.hash_ids(ids)[0], config.dspark_target_layer_ids)
    anchors = torch.tensor([[5, 20, 40], [33, 12, 1]])
    logits, confidence = drafter.teacher_forced(streams, ids, anchors, model.embed, model.lm_head)
    assert logits.shape == (6, 5, config.vocab_size) and confidence.shape == (6, 5)
    # Block 1 of sequence 1 (anchor 20) equals the inference path with the true previous tokens.
    with torch.no_grad():
        draft = drafter(streams[:1, :20], ids[0, 20:21], model.embed, model.lm_head)
        prev = ids[0:1, 20:25]
        assert torch.allclose(drafter.markov_logits(draft.logits, prev)[0], logits[1], atol=1e-3)
    # Gradients reach the projection, the layers, the Markov and confidence heads; not the backbone.
    rows = torch.arange(2).repeat_interleave(3)
    window = anchors.reshape(-1, 1) + torch.arange(5)
    loss = draft_loss(logits, confidence, teacher[rows[:, None], window], ids[rows[:, None], window + 1])
    loss.total.backward()
    named = dict(drafter.named_parameters())
    for name in ("mtp.0.main_proj.weight", "mtp.0.attn.wkv.weight", "mtp.0.attn.wq_a.weight",
                 "mtp.0.markov_head.embed.weight", "mtp.0.confidence_head.proj.weight"):
        assert named[name].grad is not None and named[name].grad.abs().sum() > 0, name
    assert all(p.grad is None for p in model.parameters())


def test_a_few_steps_fit_a_fixed_batch(tiny):
    config, model, hasher = tiny
    model.requires_grad_(False)
    drafter = init_module(DSparkDrafter(config), seed=2, std=0.08)
    ids = torch.randint(3, 2000, (2, 40), generator=torch.Generator().manual_seed(2))
    teacher, streams = target_streams(model, ids, hasher.hash_ids(ids)[0], config.dspark_target_layer_ids)
    anchors = torch.tensor([[3, 10, 17, 30], [8, 14, 22, 33]])
    rows = torch.arange(2).repeat_interleave(4)
    window = anchors.reshape(-1, 1) + torch.arange(5)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        logits, confidence = drafter.teacher_forced(streams, ids, anchors, model.embed, model.lm_head)
        loss = draft_loss(logits, confidence, teacher[rows[:, None], window], ids[rows[:, None], window + 1])
        optimizer.zero_grad()
        loss.total.backward()
        optimizer.step()
        losses.append(float(loss.total.detach()))
    assert losses[-1] < 0.8 * losses[0]
