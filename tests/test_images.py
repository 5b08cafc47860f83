"""Images through the engine: an image's span enters the sequence in place of its image
token positions, with the router's image bias there, Engram's gate shut there and no
n-gram across it; the engine agrees with the reference forward given the same spans."""

from __future__ import annotations

import pytest
import torch

from model.loader import load_checkpoint, load_hasher
from model.runtime.engine import Engine, ImageSpan
from model.vision import preprocess_image
from tests.vision_model import vision_checkpoint

IMAGE_ID = 7


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    directory = vision_checkpoint(tmp_path_factory.mktemp("vision"))
    checkpoint = load_checkpoint(directory)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # an image bias that moves the routing, so that the mask matters
        for block in checkpoint.backbone.layers:
            block.ffn.gate.bias_vl.copy_(torch.randn(block.ffn.gate.bias_vl.shape, generator=generator))
    return directory, checkpoint, load_hasher(directory, checkpoint.config)


def _image(seed: int, height: int = 50, width: int = 120) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _span(checkpoint, image: torch.Tensor, start: int, calls: list | None = None) -> ImageSpan:
    patches, plan = preprocess_image(image, checkpoint.config.vision)

    def embed() -> torch.Tensor:
        if calls is not None:
            calls.append(start)
        return checkpoint.vision(patches, plan.vit_h, plan.vit_w)

    return ImageSpan(start, plan.num_tokens, embed)


def _prompt(span_length: int) -> tuple[list[int], int]:
    before, after = list(range(20, 60)), list(range(100, 130))
    return before + [IMAGE_ID] * span_length + after, len(before)


def _reference(checkpoint, hasher, ids: list[int], span: ImageSpan) -> torch.Tensor:
    tokens = torch.tensor([ids])
    mask = tokens == IMAGE_ID
    engram_ids, _ = hasher.hash_ids(tokens, token_mask=~mask)
    return checkpoint.backbone(tokens, engram_ids, mask, span.embed())[0]


def test_an_image_prompt_matches_the_reference(reader):
    _, checkpoint, hasher = reader
    span = _span(checkpoint, _image(1), 0)
    ids, start = _prompt(span.length)
    span = _span(checkpoint, _image(1), start)
    expected = _reference(checkpoint, hasher, ids, span)
    engine = Engine(checkpoint.backbone, hasher, bounded_replay=False, image_token_id=IMAGE_ID)
    cache = engine.new_cache()
    logits = engine.replay(cache, engine.prefill(cache, ids, images=[span]))
    assert (logits - expected[-1]).abs().max() < 1e-4
    # The mask is doing work: without the image bias and the Engram rules, or with
    # another image, the answer moves.
    other = _span(checkpoint, _image(2), start)
    assert (_reference(checkpoint, hasher, ids, other)[-1] - expected[-1]).abs().max() > 1e-3
    tokens = torch.tensor([ids])
    unmasked = checkpoint.backbone(tokens, hasher.hash_ids(tokens)[0], torch.zeros_like(tokens, dtype=torch.bool))
    assert (unmasked[0, -1] - expected[-1]).abs().max() > 1e-3


def test_the_tower_runs_only_for_positions_being_encoded(reader):
    _, checkpoint, hasher = reader
    calls: list[int] = []
    span = _span(checkpoint, _image(1), 40, calls)
    ids, start = _prompt(span.length)
    engine = Engine(checkpoint.backbone, hasher, bounded_replay=False, image_token_id=IMAGE_ID)
    whole = engine.new_cache()
    expected = engine.replay(whole, engine.prefill(whole, ids, images=[span]))
    assert calls == [40]
    # In two turns: the image is encoded in the first; the second needs no tower run.
    cut = start + span.length + 10
    cache = engine.new_cache()
    engine.replay(cache, engine.prefill(cache, ids[:cut], images=[span]))
    logits = engine.replay(cache, engine.prefill(cache, ids[cut:], images=[span]))
    assert calls == [40, 40]
    assert (logits - expected).abs().max() < 1e-4
    # A cut through the image: both halves need (their part of) the span.
    cache = engine.new_cache()
    engine.replay(cache, engine.prefill(cache, ids[:start + 5], images=[span]))
    logits = engine.replay(cache, engine.prefill(cache, ids[start + 5:], images=[span]))
    assert calls == [40, 40, 40, 40] and (logits - expected).abs().max() < 1e-4


def test_image_positions_need_their_span(reader):
    _, checkpoint, hasher = reader
    engine = Engine(checkpoint.backbone, hasher, image_token_id=IMAGE_ID)
    span = _span(checkpoint, _image(1), 40)
    ids, _ = _prompt(span.length)
    with pytest.raises(ValueError, match="disagree"):
        engine.prefill(engine.new_cache(), ids)
    with pytest.raises(ValueError, match="disagree"):
        engine.prefill(engine.new_cache(), ids, images=[ImageSpan(39, span.length, span.embed)])
