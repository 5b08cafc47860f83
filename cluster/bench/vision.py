"""`v41 bench vision`: what an image costs in the prefill pool, and what the cache saves.

- **per image**: decoding (PNG), preprocessing (the processor's resize, pad, patches)
  and the vision tower (ViT, 3 x 3 merge, aligner) for images of several sizes, per
  image and per image token (median of ``--repeats``), on a tower of the released
  shape (``--tower released``: 1024 wide, 32 blocks, seeded random weights: the time
  does not depend on the values) or a small one;
- **TTFT through HTTP**: a cold turn with an image (a new image each time) against the
  returning turn of the same conversation (its history holds the image: its positions
  are read from the store, the tower does not run), streamed, medians.

The text backbone is the golden test checkpoint (``tests/golden/A``) with the tower
attached (:func:`model.loader.add_vision_tower`), served as ``v41 serve`` serves.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from cluster.bench.sse import sse_chunks

_TOWERS = {
    "released": {},
    "small": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backbone", type=Path, default=Path("tests/golden/A"), help="text checkpoint")
    parser.add_argument("--tower", choices=tuple(_TOWERS), default="released", help="vision tower shape")
    parser.add_argument("--sizes", default="544x544,768x1024,3000x2000", help="image sizes, HxW")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions (medians)")


def _png(height: int, width: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def run(args: argparse.Namespace) -> int:
    from cluster import UserError
    from model.config import VisionConfig

    try:
        sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    except ValueError:
        raise UserError(f"--sizes: expected HxW[,HxW...], got {args.sizes!r}") from None
    workdir = Path(tempfile.mkdtemp(prefix="v41-bench-vision-"))
    try:
        from model.loader import add_vision_tower

        model = add_vision_tower(args.backbone, workdir / "model", VisionConfig(**_TOWERS[args.tower]), seed=0)
        per_image = _per_image(model, sizes, args.repeats)
        ttft = _ttft(model, workdir, args.repeats)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"per image ({args.tower} tower; medians of {args.repeats})")
    print(f"{'size':>11}  {'tokens':>6}  {'decode ms':>9}  {'prep ms':>8}  {'tower s':>8}  {'tower ms/token':>14}")
    for row in per_image:
        print(f"{row['size']:>11}  {row['tokens']:>6}  {row['decode_ms']:>9.1f}  {row['preprocess_ms']:>8.1f}  "
              f"{row['tower_s']:>8.3f}  {row['tower_ms_per_token']:>14.2f}")
    print(f"\nTTFT through HTTP, a {ttft['image_tokens']}-position image in a {ttft['prompt_tokens']}-token prompt")
    print(f"{'cold (image encoded)':>34}  {ttft['cold_s']:.3f} s")
    print(f"{'returning (image read from store)':>34}  {ttft['returning_s']:.3f} s  "
          f"({ttft['returning_cached_tokens']} cached)")
    print(f"{'returning / cold':>34}  {ttft['returning_over_cold']:.4f}")
    if args.json:
        print(json.dumps({"tower": args.tower, "per_image": per_image, **ttft}))
    return 0


def _per_image(model: Path, sizes: list[tuple[int, int]], repeats: int) -> list[dict]:
    import torch

    from actors.pool_model import ImageEncoder
    from actors.state import PromptImage
    from cluster.serving.images import ImageLimits, decode_image
    from model.loader import load_checkpoint
    from model.vision import plan_image, preprocess_image

    checkpoint = load_checkpoint(model)
    encoder = ImageEncoder(checkpoint.vision, checkpoint.config.vision)
    rows = []
    for height, width in sizes:
        raw = _png(height, width, 0)
        decode, prep, tower = [], [], []
        for _ in range(repeats):
            start = time.perf_counter()
            image = decode_image(raw, ImageLimits(max_bytes=1 << 30))  # noise does not compress: big PNGs
            decode.append(time.perf_counter() - start)
            start = time.perf_counter()
            preprocess_image(image.pixels, checkpoint.config.vision)
            prep.append(time.perf_counter() - start)
            tokens = plan_image(height, width, checkpoint.config.vision).num_tokens
            start = time.perf_counter()
            with torch.no_grad():
                encoder.embed(PromptImage(0, tokens, image.pixels, image.digest))  # preprocessing + tower
            tower.append(time.perf_counter() - start - prep[-1])
        rows.append({"size": f"{height}x{width}", "tokens": tokens,
                     "decode_ms": round(1e3 * statistics.median(decode), 2),
                     "preprocess_ms": round(1e3 * statistics.median(prep), 2),
                     "tower_s": round(statistics.median(tower), 4),
                     "tower_ms_per_token": round(1e3 * statistics.median(tower) / tokens, 3)})
    return rows


def _ttft(model: Path, workdir: Path, repeats: int) -> dict:
    from cluster.serving.local import local_app
    from storage.redis_server import free_port

    port = free_port()
    args = {"model": str(model), "ssd_dir": str(workdir / "ssd-{node}"), "speculation": "off",
            "model_name": "deepseek-v4.1-small", "compiled_step": False}  # (eager: as its tables were measured)
    from model.config import ModelConfig
    from model.vision import plan_image

    with local_app(args, port=port, object_store_mb=256):
        result = asyncio.run(_turns(f"http://127.0.0.1:{port}/v1/chat/completions", repeats))
    return {**result, "image_tokens": plan_image(600, 800, ModelConfig.load(model).vision).num_tokens}


async def _turns(url: str, repeats: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async def stream(messages) -> tuple[float, str, dict]:
            start = time.perf_counter()
            first, text, usage = None, [], {}
            body = {"model": "deepseek-v4.1-small", "messages": messages, "max_tokens": 4, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with session.post(url, json=body) as reply:
                if reply.status != 200:
                    raise RuntimeError(f"HTTP {reply.status}: {await reply.text()}")
                async for chunk in sse_chunks(reply):
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", ()):
                        if choice["delta"].get("content"):
                            first = first or time.perf_counter() - start
                            text.append(choice["delta"]["content"])
            return first if first is not None else time.perf_counter() - start, "".join(text), usage

        cold, returning, cached, usage = [], [], [], {}
        for seed in range(repeats + 1):  # the first round warms the path up
            url_part = {"type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + base64.b64encode(_png(600, 800, seed + 1)).decode()}}
            first = [{"role": "user", "content": [{"type": "text", "text": "What does this picture show? " * 8},
                                                  url_part, {"type": "text", "text": "Describe it in detail."}]}]
            seconds, answer, usage = await stream(first)
            later = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the colours?"}]
            again, _, second_usage = await stream(later)
            if seed:
                cold.append(seconds)
                returning.append(again)
                cached.append(second_usage["prompt_tokens_details"]["cached_tokens"])
    cold_s, returning_s = statistics.median(cold), statistics.median(returning)
    return {"prompt_tokens": usage["prompt_tokens"],
            "cold_s": round(cold_s, 4), "returning_s": round(returning_s, 4),
            "returning_cached_tokens": int(statistics.median(cached)),
            "returning_over_cold": round(returning_s / cold_s, 4)}
