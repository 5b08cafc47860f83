"""A pool replica's share of the model: what it loads of the checkpoint, and the image
encoder a prefill replica runs over its vision tower.

Below both :mod:`actors.replica` (which builds a replica from these) and
:mod:`actors.expert_workers` (whose lead worker loads its share the same way) and
:mod:`actors.prefill` (which encodes a prompt's images), so none imports another back.
"""

from __future__ import annotations

import functools

import torch

from model.config import VisionConfig
from model.runtime.inputs import ImageSpan
from model.vision import VisionTower, preprocess_image

from .state import PromptImage


def pool_checkpoint(directory, drop_decoder: bool, shard=None):
    """What a pool's replica (or, with ``shard``, its lead worker) loads: a decoder
    replica the whole model but the vision tower (not even read); a prefill replica the
    encoder half, the CED projection and the vision tower."""
    from model.loader import load_checkpoint

    checkpoint = load_checkpoint(directory, shard=shard, vision=drop_decoder)
    if drop_decoder:
        checkpoint.backbone.keep_encoder_only()
        checkpoint.drafter = None
    return checkpoint


class ImageEncoder:
    """A prefill replica's vision tower: a prompt's images to the engine's spans,
    each run (preprocessing and tower) only when the engine encodes some of the span."""

    def __init__(self, tower: VisionTower, config: VisionConfig):
        self.tower, self.config = tower, config
        self.runs = 0  # images through the tower (tests, the vision bench)

    def spans(self, images: tuple[PromptImage, ...]) -> list[ImageSpan]:
        return [ImageSpan(image.start, image.length, functools.partial(self.embed, image)) for image in images]

    def embed(self, image: PromptImage) -> torch.Tensor:
        patches, plan = preprocess_image(image.pixels, self.config)
        if plan.num_tokens != image.length:
            raise ValueError(f"an image planned at {image.length} positions takes {plan.num_tokens}")
        self.runs += 1
        return self.tower(patches, plan.vit_h, plan.vit_w)
