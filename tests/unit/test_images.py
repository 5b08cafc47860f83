"""Images through the engine: an image's span enters the sequence in place of its image
token positions, with the router's image bias there, Engram's gate shut there and no
n-gram across it; the engine agrees with the reference forward given the same spans."""

from __future__ import annotations

import pytest
import torch

from model.loader import load_checkpoint, load_hasher
from model.runtime.engine import Engine
from model.runtime.inputs import ImageSpan
from model.vision import preprocess_image
from tests.vision_model import vision_checkpoint

pytestmark = pytest.mark.unit

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


# ---------------------------------------------------------------------- the processor
# Expected plans from the released image processor's rules (Hugging Face transformers,
# src/transformers/models/deepseek_v41/image_processing_deepseek_v41.py: plan_image_grid,
# solve_resize_ratio, llm_grid, contain_size): upscale to at least min_pixels (int()
# truncation), round the sides up to whole 14-pixel patches, cost h * (w + 1) + 2 text
# positions for an h x w grid of 3 x 3 patch cells; over 1,024, shrink by the closed
# form; fit the image inside the box (one side exact), centre it (offsets round(gap / 2))
# and pad with grey 127.

def _released_plan(height: int, width: int) -> tuple[tuple[int, int], tuple[int, int], int]:
    """(box, content, positions) by those rules, written out here independently."""
    import math

    patch, cell, budget, min_pixels = 14, 42, 1024, 544 * 544
    h, w = height, width
    if h * w < min_pixels:
        grow = math.sqrt(min_pixels / (h * w))
        h, w = int(h * grow), int(w * grow)
    box = (math.ceil(h / patch) * patch, math.ceil(w / patch) * patch)

    def cost(b):
        return math.ceil(b[0] / cell) * (math.ceil(b[1] / cell) + 1) + 2

    if cost(box) > budget:
        n_w = math.sqrt((budget - 2) / (h / w) + 0.25) - 0.5
        n_h = n_w * h / w
        if n_w < 1:
            box = ((budget - 2) // 2 * cell, cell)
        elif n_h < 1:
            box = (cell, (budget - 3) * cell)
        else:
            beta = min(math.floor(n_w) * cell / w, math.floor(n_h) * cell / h)
            box = (math.floor(h * beta / patch) * patch, math.floor(w * beta / patch) * patch)
    if width / height > box[1] / box[0]:
        content = (round(height / width * box[1]), box[1])
    elif width / height < box[1] / box[0]:
        content = (box[0], round(width / height * box[0]))
    else:
        content = box
    return box, content, cost(box)


@pytest.mark.parametrize("size, box, content, positions", [
    ((1, 1), (546, 546), (546, 546), 184),           # upscaled to 546 x 546: a 13 x 13 grid
    ((1, 4000), (14, 34412), (9, 34412), 823),       # one row of 820 cells
    ((4000, 1), (21462, 42), (21462, 5), 1024),      # one column, the whole budget
    ((588, 3024), (588, 3024), (588, 3024), 1024),   # exactly the budget: 14 x 72 cells
    ((588, 3025), (546, 2800), (544, 2800), 886),    # one pixel more: shrunk (n_h = 13.997 floors to 13)
    ((4000, 3000), (1512, 1134), (1512, 1134), 1010),  # large: shrunk to 36 x 27 cells
    ((50, 120), (364, 854), (356, 854), 200),        # upscaled by 7.02 to 351 x 842, boxed
])
def test_the_processor_plans_awkward_sizes_as_the_release(size, box, content, positions):
    from model.config import ModelConfig
    from model.vision import plan_image

    released = ModelConfig.load("configs/deepseek-v4.1-flash").vision
    plan = plan_image(*size, released)
    assert _released_plan(*size) == (box, content, positions)
    assert ((plan.height, plan.width), (plan.content_height, plan.content_width), plan.num_tokens) == \
        (box, content, positions)
    assert plan.vit_h * 14 == plan.height and plan.llm_w == -(-plan.vit_w // 3)


def test_the_processor_pixels_are_the_released_values():
    """A flat colour stays flat through the bicubic resize; padding is grey 127; values
    are x / 255 normalised with mean 0.5, std 0.5; patches row-major, channel-major."""
    from model.config import ModelConfig
    from model.vision import preprocess_image

    released = ModelConfig.load("configs/deepseek-v4.1-flash").vision
    colour = torch.tensor([200, 100, 50], dtype=torch.uint8)
    patches, plan = preprocess_image(colour.view(3, 1, 1).expand(3, 1, 4000).contiguous(), released)
    assert (plan.vit_h, plan.vit_w) == (1, 2458) and patches.shape == (1 * 2458, 3 * 14 * 14)
    pixels = patches.view(-1, 3, 14, 14)  # every patch: channels, rows, columns
    grey = (127 / 255 - 0.5) / 0.5
    expected_rows = torch.tensor([grey] * 2 + [1.0] * 9 + [grey] * 3)  # content rows 2..10: round(5 / 2) = 2 on top
    for channel, value in enumerate(colour.tolist()):
        flat = (value / 255 - 0.5) / 0.5
        want = torch.where(expected_rows == 1.0, torch.tensor(flat), expected_rows)
        assert torch.allclose(pixels[:, channel, :, 0], want.expand(2458, 14), atol=1e-6)


# ---------------------------------------------------------------------- decoding
def _encoded(array, mode: str | None = None, fmt: str = "PNG", **info) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    image = Image.fromarray(np.asarray(array, dtype=np.uint8), mode) if mode != "P" else array
    buffer = io.BytesIO()
    image.save(buffer, fmt, **info)
    return buffer.getvalue()


def _data_url(raw: bytes, kind: str = "png") -> str:
    import base64

    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


def test_images_decode_to_rgb_as_the_released_processor():
    import numpy as np
    from PIL import Image

    from cluster.serving.images import ImageLimits, read_image

    limits = ImageLimits()
    rgba = np.zeros((2, 3, 4), dtype=np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)      # opaque red stays red
    rgba[0, 1] = (0, 0, 0, 0)          # transparent: white
    rgba[0, 2] = (0, 0, 255, 128)      # half blue over white
    image = read_image(_data_url(_encoded(rgba)), limits)
    assert image.pixels.shape == (3, 2, 3) and image.pixels.dtype == torch.uint8
    assert image.pixels[:, 0, 0].tolist() == [255, 0, 0] and image.pixels[:, 0, 1].tolist() == [255, 255, 255]
    assert image.pixels[:, 0, 2].tolist() == [127, 127, 255]
    grey = read_image(_data_url(_encoded(np.full((4, 5), 77))), limits)
    assert grey.pixels.shape == (3, 4, 5) and bool((grey.pixels == 77).all())
    palette = Image.new("P", (2, 1))
    palette.putpalette([10, 20, 30, 40, 50, 60] + [0] * 762)
    palette.putpixel((0, 0), 0)
    palette.putpixel((1, 0), 1)
    seen = read_image(_data_url(_encoded(palette, "P", transparency=1)), limits)
    assert seen.pixels[:, 0, 0].tolist() == [10, 20, 30] and seen.pixels[:, 0, 1].tolist() == [255, 255, 255]
    # The digest names the pixels: the same picture in another lossless format shares it.
    again = read_image(_data_url(_encoded(rgba[..., :3], fmt="BMP"), "bmp"), limits)
    flat = read_image(_data_url(_encoded(rgba[..., :3])), limits)
    assert again.digest == flat.digest != image.digest


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,AAAA", "cannot be decoded"),
    ("data:image/png;base64,%%%", "base64 is malformed"),
    ("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
    ("https://example.com/a.png", "fetches nothing from the network"),
    ("file:///etc/passwd", "file URLs are off"),
    ("ftp://x/y.png", "must be a data: URL"),
])
def test_unusable_images_are_refused_with_a_reason(url, message):
    from cluster.serving.images import ImageError, ImageLimits, read_image

    with pytest.raises(ImageError, match=message):
        read_image(url, ImageLimits())


def test_image_limits_and_the_allowed_directory(tmp_path):
    import numpy as np

    from cluster.serving.images import ImageError, ImageLimits, read_image

    raw = _encoded(np.random.default_rng(0).integers(0, 256, (40, 30, 3)))  # ~3.6 KB: noise does not compress
    with pytest.raises(ImageError, match="over 100 bytes"):
        read_image(_data_url(raw), ImageLimits(max_bytes=100))
    with pytest.raises(ImageError, match="40 x 40 pixels"):  # refused before decoding
        read_image(_data_url(_encoded(np.zeros((40, 40, 3)))), ImageLimits(max_pixels=1000))
    allowed = tmp_path / "images"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(raw)
    (tmp_path / "b.png").write_bytes(raw)
    limits = ImageLimits(image_dir=str(allowed))
    assert read_image(f"file://{allowed / 'a.png'}", limits).pixels.shape == (3, 40, 30)
    for outside in (f"file://{tmp_path / 'b.png'}", f"file://{allowed}/../b.png"):
        with pytest.raises(ImageError, match="under"):
            read_image(outside, limits)


# ---------------------------------------------------------------------- the chat and the API
def test_image_parts_render_as_image_tokens_in_place(golden_dir):
    from model.chat import ChatTemplate, ImagePart, Message
    from model.tokenizer import Tokenizer

    template = ChatTemplate(Tokenizer.from_dir(golden_dir))
    plain = template.render([Message("user", "look at this")])
    assert template.render([Message("user", parts=("look at this",))]) == plain  # text only: unchanged
    ids = template.render([Message("user", parts=("look: ", ImagePart(5), " what is it?"))])
    start = ids.index(IMAGE_ID)
    assert ids[start:start + 5] == [IMAGE_ID] * 5 and IMAGE_ID not in ids[start + 5:]
    assert template.tokenizer.decode(ids[:start]).endswith("look: ")
    with pytest.raises(ValueError, match="only user turns carry images"):
        Message("assistant", parts=(ImagePart(3),))


def test_the_api_reads_image_parts_and_names_mistakes():
    from cluster.serving import openai_api as api

    def read(url, earlier):
        if url == "bad":
            raise ValueError("the image cannot be decoded")
        return 6, f"image {url}"

    def chat(content, reader=read, max_images=2):
        return api.parse_chat({"model": "m", "messages": [{"role": "user", "content": content}]}, "m", 16, 100,
                              reader, max_images)

    image = {"type": "image_url", "image_url": {"url": "a"}}
    request = chat([{"type": "text", "text": "see "}, image, {"type": "text", "text": " and"}, image])
    assert request.images == ((6, "image a"), (6, "image a"))
    assert [type(p).__name__ for p in request.messages[0].parts] == ["str", "ImagePart", "str", "ImagePart"]
    for content, reader, param, message in [
        ([image], None, "messages[0].content[0].image_url", "this model reads no images"),
        ([image, image, image], read, "messages[0].content[2].image_url", "at most 2 images"),
        ([{"type": "image_url", "image_url": {"url": "bad"}}], read, "messages[0].content[0].image_url",
         "cannot be decoded"),
        ([{"type": "image_url", "image_url": {"url": "a", "detail": "high"}}], read, "messages",
         "image_url.detail: Input should be 'auto'"),
        ([{"type": "input_audio", "input_audio": {}}], read, "messages", "does not match any of the expected tags"),
    ]:
        with pytest.raises(api.ApiError) as refused:
            chat(content, reader)
        assert refused.value.status == 400 and refused.value.body()["error"]["param"] == param
        assert message in refused.value.body()["error"]["message"]


# ---------------------------------------------------------------------- the pools' services
@pytest.fixture()
def image_pools(reader, tmp_path):
    from actors.pool_model import ImageEncoder
    from actors.state import StateNaming
    from model.loader import weights_digest
    from model.runtime.serialize import StateIdentity
    from storage.keys import Fingerprint
    from storage.policy import RetentionPolicy
    from storage.store import StoreConfig, TieredStore

    directory, checkpoint, hasher = reader
    identity = StateIdentity.of(checkpoint.config.text, weights_digest(directory), "golden-tokenizer")
    naming = StateNaming.of(identity, checkpoint.config.text, 32)
    store = TieredStore(StoreConfig(node_id="n1", ssd_dir=tmp_path / "ssd",
                                    retention=RetentionPolicy(ram_capacity_bytes=64 << 20)), Fingerprint(identity.model))
    engine = Engine(checkpoint.backbone, hasher, bounded_replay=False, image_token_id=IMAGE_ID)
    yield engine, store, naming, ImageEncoder(checkpoint.vision, checkpoint.config.vision), checkpoint
    store.close()


def _turn(pools, tokens: list[int], images: tuple, n: int = 6):
    from actors.decoder import DecoderService
    from actors.prefill import PrefillService
    from actors.state import CachePlan, media_of
    from model.runtime.sampling import SamplingParams

    engine, store, naming, encoder, _ = pools
    match = store.lookup_prefix(naming.chunks(tokens, media=media_of(images)))
    plan = CachePlan(tuple(tokens), match.chunks, images=images)
    handoff = PrefillService(engine, store, naming, images=encoder).prefill(plan)
    decoder = DecoderService(engine, store, naming)
    events = [decoder.admit("r", handoff, SamplingParams(temperature=0.0, max_tokens=n))]
    while decoder.running:
        events += decoder.step()
    decoder.write_pending()
    assert store.flush(timeout=10)
    return handoff.cached_tokens, [e.token_id for e in events]


def test_a_returning_turn_reads_its_image_from_the_store_not_the_tower(image_pools):
    from actors.state import PromptImage
    from cluster.serving.images import pixel_digest

    engine, _, _, encoder, checkpoint = image_pools
    pixels = _image(1)
    span = _span(checkpoint, pixels, 0)
    ids, start = _prompt(span.length)
    image = PromptImage(start, span.length, pixels, pixel_digest(pixels))
    cached, answer = _turn(image_pools, ids, (image,))
    assert (cached, encoder.runs) == (0, 1)
    second = ids + answer + [3, 40, 21, 4, 5, 6]
    cached, warm = _turn(image_pools, second, (image,))
    assert encoder.runs == 1 and cached == len(ids) + len(answer) - 1  # the whole first turn, image included
    cold = Engine(engine.model, engine.hasher, bounded_replay=False, image_token_id=IMAGE_ID)
    cache = cold.new_cache()
    tokens = [int(cold.replay(cache, cold.prefill(cache, second, images=[_span(checkpoint, pixels, start)])).argmax())]
    while len(tokens) < 6:
        tokens.append(int(cold.decode([(cache, [tokens[-1]])])[0][-1].argmax()))
    assert warm == tokens
    # Another image in the same place shares only the chunks before it.
    other_pixels = _image(2)
    other = PromptImage(start, span.length, other_pixels, pixel_digest(other_pixels))
    cached, _ = _turn(image_pools, second, (other,))
    assert cached == start // 32 * 32 and encoder.runs == 2


def test_the_decoder_pool_holds_no_vision_weights(reader, tensor_reads):
    from actors.config import AppConfig
    from actors.replica import ModelBundle

    directory, _, _ = reader
    read = tensor_reads
    config = AppConfig.from_args({"model": str(directory), "compiled_step": False})
    decoder = ModelBundle(config)
    assert decoder.vision is None and decoder.image_encoder() is None
    assert read and not any(name.startswith(("vision.", "aligner.", "image_")) for name in read)
    assert not any(name.startswith(("vision", "aligner", "image_")) for name, _ in decoder.engine.model.named_parameters())
    assert decoder.engine.image_token_id == IMAGE_ID  # its replays still treat image positions as images
    prefill = ModelBundle(config, drop_decoder=True)
    assert prefill.image_encoder() is not None


@pytest.mark.slow
@pytest.mark.e2e
def test_a_chat_with_an_image_through_the_openai_sdk(reader, serve_runtime, tmp_path):
    """An image answered; the next turn hits the cache for its positions; another image
    in the same place does not."""
    import numpy as np
    import openai

    from model.chat import ChatTemplate, ImagePart, Message
    from model.tokenizer import Tokenizer
    from model.vision import plan_image

    directory, _, _ = reader

    def image_part(seed: int) -> dict:
        pixels = np.random.default_rng(seed).integers(0, 256, (50, 120, 3))
        return {"type": "image_url", "image_url": {"url": _data_url(_encoded(pixels))}}

    def turn(image: dict) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": "what is in this picture? " * 4}, image,
                                              {"type": "text", "text": " answer in one word please" * 6}]}]

    with serve_runtime.app(tmp_path, model=str(directory)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

        def ask(messages):
            response = client.chat.completions.create(model="deepseek-v4.1-small", messages=messages, max_tokens=6,
                                                      temperature=0)
            return response.choices[0].message.content, response.usage

        first = turn(image_part(1))
        answer, usage = ask(first)
        assert usage.prompt_tokens_details.cached_tokens == 0
        prompt = usage.prompt_tokens
        checkpoint = load_checkpoint(directory)
        span = plan_image(50, 120, checkpoint.config.vision).num_tokens
        rendered = ChatTemplate(Tokenizer.from_dir(directory)).render(
            [Message("user", parts=(first[0]["content"][0]["text"], ImagePart(span), first[0]["content"][2]["text"]))])
        assert len(rendered) == prompt
        image_start = rendered.index(IMAGE_ID)
        second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and its colours?"}]
        _, usage = ask(second)
        assert usage.prompt_tokens_details.cached_tokens >= prompt - 32  # every whole chunk of turn one, image included
        _, usage = ask(turn(image_part(2)))
        assert usage.prompt_tokens_details.cached_tokens == image_start // 32 * 32  # only the chunks before the image
        with pytest.raises(openai.BadRequestError) as refused:
            ask([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
        assert refused.value.body["param"] == "messages[0].content[0].image_url"
