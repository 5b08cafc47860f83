"""A checkpoint that reads images, for tests: the golden backbone (tests/golden/A) with a
small vision tower of seeded random weights, saved in the released layout."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden" / "A"

# A tower small enough for the suite: 32 wide, 2 blocks; images of at least 84 x 84
# pixels (6 x 6 patches, a 2 x 2 token grid) and at most 64 text positions.
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "max_image_tokens": 64, "min_pixels": 84 * 84}


def vision_checkpoint(directory: Path) -> Path:
    """Write the checkpoint into ``directory`` (created) and return it."""
    from model.config import VisionConfig
    from model.loader import load_checkpoint, save_checkpoint
    from model.transformer import init_module
    from model.vision import VisionTower

    checkpoint = load_checkpoint(GOLDEN)
    vision = VisionConfig(**VISION)
    image_token_id = 7  # <｜deepseek_image｜> in the golden tokenizer
    config = dataclasses.replace(checkpoint.config, vision=vision, image_token_id=image_token_id)
    tower = init_module(VisionTower(vision, config.text), seed=11, std=0.1).eval()
    save_checkpoint(directory, dataclasses.replace(checkpoint, config=config, vision=tower), quantize=False)
    for path in GOLDEN.iterdir():
        if path.suffix == ".json" and path.name != "config.json":
            shutil.copy(path, directory / path.name)
    return directory
