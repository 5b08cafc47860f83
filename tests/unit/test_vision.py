"""Vision input path: released names and shapes on meta, preprocessing numbers, 2D RoPE,
the 3x3 merge and a tiny end-to-end forward."""

from __future__ import annotations

import math

import pytest
import torch

from model.config import TextConfig, VisionConfig
from model.vision import (
    IMAGE_MEAN,
    IMAGE_STD,
    PAD_VALUE,
    VisionTower,
    apply_rope_2d,
    merge_patches,
    num_image_tokens,
    patchify,
    plan_image,
    preprocess_image,
    rope_2d,
)

pytestmark = pytest.mark.unit

FULL_VISION = VisionConfig()
TINY_VISION = VisionConfig(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, patch_size=2,
    max_image_tokens=40, min_pixels=144,
)
GREY = (PAD_VALUE / 255 - IMAGE_MEAN) / IMAGE_STD


def _tiny_text(hidden: int = 24) -> TextConfig:
    return TextConfig(hidden_size=hidden)


def test_full_tower_has_the_released_names_and_shapes_on_meta():
    with torch.device("meta"):
        tower = VisionTower(FULL_VISION, TextConfig())
    shapes = {name: tuple(p.shape) for name, p in tower.named_parameters()}
    assert len(shapes) == 266  # 32 blocks x 8 + patch (2) + final norm + aligner (4) + 3 markers
    assert shapes["vision.patch_embed.proj.weight"] == (1024, 588)
    assert shapes["vision.patch_embed.proj.bias"] == (1024,)
    assert shapes["vision.blocks.0.attn.wqkv.weight"] == (3072, 1024)
    assert shapes["vision.blocks.0.attn.wqkv.bias"] == (3072,)
    assert shapes["vision.blocks.31.attn.wo.weight"] == (1024, 1024)
    assert shapes["vision.blocks.31.attn.wo.bias"] == (1024,)
    assert shapes["vision.blocks.31.mlp.w1.weight"] == (5632, 1024)
    assert shapes["vision.blocks.31.mlp.w2.weight"] == (1024, 2816)
    assert shapes["vision.blocks.7.norm1.weight"] == shapes["vision.blocks.7.norm2.weight"] == (1024,)
    assert shapes["vision.norm.weight"] == (1024,)
    assert shapes["aligner.w1.weight"] == (5120, 9216)
    assert shapes["aligner.w1.bias"] == (5120,)
    assert shapes["aligner.w2.weight"] == (5120, 5120)
    assert shapes["aligner.w2.bias"] == (5120,)
    for marker in ("image_start", "image_end", "image_newline"):
        assert shapes[marker] == (5120,)
    assert "vision.blocks.32.norm1.weight" not in shapes
    assert all(n.startswith(("vision.", "aligner.", "image_")) for n in shapes)
    d, inter = 1024, 2816
    block = (3 * d * d + 3 * d) + (d * d + d) + 2 * inter * d + inter * d + 2 * d
    expected = 32 * block + (588 * d + d) + d + (9 * d * 5120 + 5120) + (5120 * 5120 + 5120) + 3 * 5120
    total = sum(p.numel() for p in tower.parameters())
    assert total == expected
    assert 0.45e9 < total < 0.52e9


@pytest.mark.parametrize("height, width", [(700, 1000), (1000, 700)])
def test_plan_of_a_1000_by_700_image(height, width):
    plan = plan_image(height, width, FULL_VISION)
    assert plan.num_tokens == plan.llm_h * (plan.llm_w + 1) + 2 <= 1024
    assert plan.height * plan.width >= 544 * 544
    assert plan.height % 14 == 0 and plan.width % 14 == 0
    assert (plan.vit_h, plan.vit_w) == (plan.height // 14, plan.width // 14)
    assert (plan.llm_h, plan.llm_w) == (math.ceil(plan.vit_h / 3), math.ceil(plan.vit_w / 3))
    # Already large enough and under the cap: only rounded up to whole patches.
    assert sorted((plan.height, plan.width)) == [700, 1008]
    assert (plan.content_height, plan.content_width) == (height, width)
    assert sorted((plan.llm_h, plan.llm_w)) == [17, 24]
    assert plan.num_tokens == (17 * 25 + 2 if height == 700 else 24 * 18 + 2)


def test_grey_padding_and_normalisation_in_the_patches():
    image = torch.full((3, 700, 1000), 255, dtype=torch.uint8)
    patches, plan = preprocess_image(image, FULL_VISION)
    assert patches.shape == (plan.vit_h * plan.vit_w, 588)
    assert (plan.top, plan.left) == (0, 4)
    pixels = patches.reshape(plan.vit_h, plan.vit_w, 3, 14, 14)
    left_strip = pixels[:, 0, :, :, :4]  # the 4 padded columns on the left edge
    right_strip = pixels[:, -1, :, :, -4:]
    assert torch.allclose(left_strip, torch.tensor(GREY)) and torch.allclose(right_strip, torch.tensor(GREY))
    assert abs(GREY - (127 / 255 - 0.5) / 0.5) < 1e-9 and -0.01 < GREY < 0
    assert torch.allclose(pixels[:, 1:-1], torch.tensor(1.0))  # white content, normalised


def test_small_image_is_upscaled_to_the_minimum_area():
    plan = plan_image(80, 100, FULL_VISION)
    assert plan.height * plan.width >= FULL_VISION.min_pixels == 544 * 544
    assert plan.num_tokens <= 1024
    # Content keeps the aspect ratio inside the box.
    assert abs(plan.content_width / plan.content_height - 100 / 80) < 0.01


@pytest.mark.parametrize("height, width", [(2000, 2000), (3000, 4000), (4000, 1500), (300, 9000)])
def test_large_images_shrink_under_the_token_cap(height, width):
    plan = plan_image(height, width, FULL_VISION)
    assert plan.num_tokens <= 1024
    assert plan.content_height <= plan.height and plan.content_width <= plan.width
    if height == width:  # a square image tops out at 31 x 31 tokens (31 * 32 + 2 = 994)
        assert (plan.llm_h, plan.llm_w) == (31, 31)
    if (height, width) == (3000, 4000):
        assert plan.num_tokens > 900  # the shrink uses most of the budget
        assert abs((plan.width / plan.height) - 4 / 3) < 0.05


def test_patchify_is_row_major_and_channel_major_inside_a_patch():
    pixels = torch.arange(3 * 4 * 6, dtype=torch.float32).reshape(3, 4, 6)
    patches = patchify(pixels, 2)
    assert patches.shape == (2 * 3, 12)
    # Patch 4 is row 1, column 1: pixels rows 2..3, columns 2..3.
    assert torch.equal(patches[4], pixels[:, 2:4, 2:4].reshape(-1))


def test_2d_rope_is_a_norm_preserving_rotation():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 16)
    rows, cols = torch.tensor([0, 1, 2, 7, 30]), torch.tensor([0, 4, 1, 9, 2])
    cos, sin = rope_2d(rows, cols, 16, 10000.0)
    assert cos.shape == (5, 8)
    y = apply_rope_2d(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(y[0], x[0])  # position (0, 0) is the identity
    assert not torch.allclose(y[1], x[1])


def test_2d_rope_is_relative_in_both_axes():
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 64), torch.randn(1, 1, 64)

    def score(qr, qc, kr, kc):
        cq, sq = rope_2d(torch.tensor([qr]), torch.tensor([qc]), 64, 10000.0)
        ck, sk = rope_2d(torch.tensor([kr]), torch.tensor([kc]), 64, 10000.0)
        return (apply_rope_2d(q, cq, sq) * apply_rope_2d(k, ck, sk)).sum()

    base = score(3, 5, 1, 2)
    assert torch.allclose(base, score(3 + 7, 5 + 11, 1 + 7, 2 + 11), atol=1e-4)
    assert torch.allclose(base, score(3 + 4, 5, 1 + 4, 2), atol=1e-4)
    # Rows and columns are distinct axes: swapping them changes the score.
    assert not torch.allclose(base, score(5, 3, 2, 1), atol=1e-3)


def test_merge_unfolds_3x3_blocks_channel_major_with_zero_edges():
    vit_h, vit_w, d = 4, 5, 2
    features = torch.arange(vit_h * vit_w * d, dtype=torch.float32).reshape(vit_h * vit_w, d) + 1
    merged = merge_patches(features, vit_h, vit_w, 3)
    assert merged.shape == (2 * 2, d * 9)
    grid = features.reshape(vit_h, vit_w, d)
    for dy in range(3):
        for dx in range(3):
            for c in range(d):
                assert merged[0, c * 9 + dy * 3 + dx] == grid[dy, dx, c]
    # Block (1, 1) covers rows 3..5 and columns 3..5: only (3, 3) and (3, 4) exist.
    assert merged[3, 0 * 9 + 0 * 3 + 0] == grid[3, 3, 0]
    assert merged[3, 1 * 9 + 0 * 3 + 1] == grid[3, 4, 1]
    assert merged[3, 0 * 9 + 1 * 3 + 0] == 0 and merged[3, 1 * 9 + 0 * 3 + 2] == 0


def _random_tower(text_hidden: int = 24) -> VisionTower:
    torch.manual_seed(0)
    tower = VisionTower(TINY_VISION, _tiny_text(text_hidden))
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.2)
    return tower


def test_tiny_tower_forward_builds_the_span():
    tower = _random_tower()
    image = torch.randint(0, 256, (3, 13, 17), dtype=torch.uint8)
    patches, plan = preprocess_image(image, TINY_VISION)
    assert plan.num_tokens <= TINY_VISION.max_image_tokens
    span = tower(patches, plan.vit_h, plan.vit_w)
    assert span.dtype == torch.float32
    assert span.shape == (num_image_tokens(plan.llm_h, plan.llm_w), 24)
    tokens = tower.encode(patches, plan.vit_h, plan.vit_w)
    assert tokens.shape == (plan.llm_h * plan.llm_w, 24)
    assert torch.equal(span[0], tower.image_start.detach())
    assert torch.equal(span[-1], tower.image_end.detach())
    row = plan.llm_w + 1
    for r in range(plan.llm_h):
        assert torch.equal(span[1 + r * row + plan.llm_w], tower.image_newline.detach())
        assert torch.allclose(span[1 + r * row : 1 + r * row + plan.llm_w], tokens[r * plan.llm_w : (r + 1) * plan.llm_w])


def test_every_patch_sees_every_other_patch():
    tower = _random_tower()
    torch.manual_seed(3)
    patches = torch.randn(6 * 6, 12)
    features = tower.vision(patches, 6, 6)
    changed = patches.clone()
    changed[-1] += 1.0  # the last patch (bottom right)
    after = tower.vision(changed, 6, 6)
    assert not torch.allclose(features[0], after[0])  # the first patch's output moved: no causal mask
