"""A checkpoint that reads images, for tests: the golden backbone (tests/golden/A) with a
small vision tower of seeded random weights, saved in the released layout."""

from __future__ import annotations

from pathlib import Path

GOLDEN = Path(__file__).parent / "golden" / "A"

# A tower small enough for the suite: 32 wide, 2 blocks; images of at least 84 x 84
# pixels (6 x 6 patches, a 2 x 2 token grid) and at most 64 text positions.
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "max_image_tokens": 64, "min_pixels": 84 * 84}


def vision_checkpoint(directory: Path) -> Path:
    """Write the checkpoint into ``directory`` (created) and return it."""
    from model.config import VisionConfig
    from model.loader import add_vision_tower

    return add_vision_tower(GOLDEN, directory, VisionConfig(**VISION), seed=11, std=0.1)
