"""`v41 train-vision`'s parts: the snippets and their images, the transcription score,
and the tower learning through a frozen backbone (its gradient reaches only the tower)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cluster.cli.train_vision import (
    Example,
    _loss,
    char_accuracy,
    edit_distance,
    font_paths,
    patch_glyphs,
    render,
    render_with_boxes,
    snippets,
)
from tests.vision_model import vision_checkpoint

pytestmark = pytest.mark.unit


def test_snippets_are_short_runs_of_lines():
    text = "def f(x):\n    return x + 1\n\n" + "y = '" + "z" * 40 + "'\nprint(y)\n"
    found = snippets([text])
    assert "def f(x):" in found and "def f(x):\n    return x + 1" in found
    assert all(0 < len(line) <= 32 for snippet in found for line in snippet.split("\n"))
    assert all(snippet.count("\n") <= 1 for snippet in found)
    assert not any("zzz" in snippet for snippet in found)


def test_rendered_text_is_dark_on_white_where_the_text_is():
    pixels = render("x = 1\nyy = 22", font_paths()[0], 20, 8)
    assert pixels.dtype == torch.uint8 and pixels.shape[0] == 3
    assert bool((pixels[:, :8] == 255).all()) and bool((pixels[:, :, :8] == 255).all())  # the margins
    assert int((pixels[0] < 100).sum()) > 50  # the glyphs
    assert render("x = 1\nyy = 22", font_paths()[0], 20, 8).shape[1] > render("x = 1", font_paths()[0], 20, 8).shape[1]


def test_each_patch_is_labelled_with_the_glyph_it_mostly_shows():
    from model.config import VisionConfig
    from model.vision import plan_image

    pixels, boxes = render_with_boxes("AB  C", font_paths()[0], 28, 0)  # no margin: the glyphs start at x = 0
    assert [b[4] for b in boxes] == ["A", "B", "C"] and boxes[0][0] == 0
    advance = boxes[1][0]  # monospaced: every glyph as wide
    assert boxes[2][0] == 4 * advance
    plan = plan_image(pixels.shape[1], pixels.shape[2], VisionConfig(min_pixels=1))
    labels = patch_glyphs(boxes, plan, pixels.shape[1], pixels.shape[2]).view(plan.vit_h, plan.vit_w)
    row = labels[plan.vit_h // 2].tolist()  # a patch row through the middle of the line
    glyphs = [chr(32 + c) for c in row if c]
    assert glyphs[0] == "A" and glyphs[-1] == "C" and set(glyphs) == {"A", "B", "C"}
    assert row[0] == ord("A") - 32
    last_b = max(i for i, c in enumerate(row) if c == ord("B") - 32)
    first_c = row.index(ord("C") - 32)
    assert 0 in row[last_b:first_c]  # the two spaces: at least one patch shows no glyph


def test_the_transcription_score():
    assert edit_distance("kitten", "sitting") == 3
    assert char_accuracy("abd", "abc") == 1 - 1 / 3
    assert char_accuracy("", "abc") == 0.0 and char_accuracy("a" * 10, "abc") == 0.0


def test_the_tower_learns_through_the_frozen_backbone(tmp_path):
    from model.chat import ChatTemplate
    from model.tokenizer import Tokenizer
    from model.loader import load_checkpoint, load_hasher

    directory = vision_checkpoint(tmp_path / "model")
    checkpoint = load_checkpoint(directory)
    backbone, tower = checkpoint.backbone, checkpoint.vision.train()
    backbone.requires_grad_(False)
    template = ChatTemplate(Tokenizer.from_dir(directory))
    examples = [Example(template, checkpoint.config.vision, text, render(text, font_paths()[i], 18, 6))
                for i, text in enumerate(["x = 1", "def f():\n    pass"])]
    hasher = load_hasher(directory, checkpoint.config)
    optimizer = torch.optim.AdamW(tower.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = _loss(backbone, tower, hasher, examples, 7, template.tokenizer.special.pad, F)
        optimizer.zero_grad()
        loss.backward()
        if not losses:
            assert all(p.grad is None for p in backbone.parameters())
            assert tower.aligner.w1.weight.grad.abs().sum() > 0 and tower.vision.patch_embed.proj.weight.grad.abs().sum() > 0
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.slow
def test_a_run_from_init_starts_from_that_tower(tmp_path):
    """`v41 train-vision --init DIR` continues DIR's tower: given no training time, it
    writes that tower back as the release stores a tower, in BF16 (this test's tower is
    stored in fp32); a checkpoint with no tower of the trained size is refused."""
    import argparse

    import pytest

    from cluster.cli import train_vision
    from model.config import VisionConfig
    from model.loader import add_vision_tower, load_checkpoint
    from tests.vision_model import GOLDEN

    start = add_vision_tower(GOLDEN, tmp_path / "start", VisionConfig(**train_vision.VISION), seed=11, std=0.1)
    args = argparse.Namespace(checkpoint=GOLDEN, out=tmp_path / "out", minutes=0.0, batch=2, lr=1e-3, seed=0,
                              glyph_weight=0.5, eval=1, evaluate_only=False, init=start)
    assert train_vision.run(args) == 0
    before, after = load_checkpoint(start).vision.state_dict(), load_checkpoint(args.out).vision.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k].to(torch.bfloat16).float(), after[k]) for k in before)
    assert not all(torch.equal(before[k], after[k]) for k in before)  # (it was rounded)
    assert load_checkpoint(args.out).backbone.state_dict().keys() == load_checkpoint(GOLDEN).backbone.state_dict().keys()
    for wrong in (GOLDEN, vision_checkpoint(tmp_path / "smaller")):
        with pytest.raises(SystemExit):
            train_vision.run(argparse.Namespace(**{**vars(args), "init": wrong}))
