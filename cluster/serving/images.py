"""Images in requests: an ``image_url`` part's URL to RGB pixels, a content digest and
the positions its span takes in the prompt.

Accepted: ``data:image/...;base64,...`` URLs, and ``file://`` URLs of files under the
directory the server was started with (``image_dir``; off by default). The server
fetches nothing from the network. Decoding follows the released processor's input
rules (``convert_to_rgb`` of Hugging Face transformers' image transforms, which the
DeepSeek V4.1 image processors call): an image with an alpha channel or a palette
transparency is laid on white; every other mode (greyscale, palette, CMYK, ...) is
converted to RGB; an animation gives its first frame. Every failure is an
:class:`ImageError` whose message a client can act on (the router answers 400).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
import torch


class ImageError(ValueError):
    """An image a request cannot use (the message says why)."""


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be (the app's ``max_images_per_request``,
    ``max_image_bytes``, ``max_image_pixels``, ``image_dir``)."""

    max_images: int = 8
    max_bytes: int = 8 << 20  # encoded, per image
    max_pixels: int = 40_000_000  # decoded width x height, per image (checked before decoding)
    max_request_pixels: int = 40_000_000  # the same, of all a request's images together
    image_dir: str | None = None


@dataclass(frozen=True)
class DecodedImage:
    """An image as the model sees it before preprocessing: ``pixels`` [3, H, W] uint8 RGB;
    ``digest`` (16 bytes) names exactly these pixels."""

    pixels: torch.Tensor
    digest: bytes

    @property
    def height(self) -> int:
        return self.pixels.shape[1]

    @property
    def width(self) -> int:
        return self.pixels.shape[2]


def read_image(url: str, limits: ImageLimits, pixels_before: int = 0) -> DecodedImage:
    """The image an ``image_url`` part names; ``pixels_before``: those of the request's
    images before it."""
    return decode_image(_image_bytes(url, limits), limits, pixels_before)


def _image_bytes(url: str, limits: ImageLimits) -> bytes:
    if url.startswith("data:"):
        header, comma, data = url.partition(",")
        if not comma or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise ImageError("a data URL image must be data:image/<type>;base64,<data>")
        if len(data) > (limits.max_bytes + 2) // 3 * 4 + 4:
            raise ImageError(f"the image is over {limits.max_bytes} bytes")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("the data URL's base64 is malformed") from None
    scheme = urlparse(url).scheme
    if scheme == "file":
        if limits.image_dir is None:
            raise ImageError("file URLs are off: start the server with an image directory to allow them")
        root = Path(limits.image_dir).resolve()
        path = Path(unquote(urlparse(url).path)).resolve()
        if not path.is_relative_to(root):
            raise ImageError(f"file URLs must name files under {root}")
        try:
            status = path.stat()
            if not stat.S_ISREG(status.st_mode):  # (a FIFO or a device would block or never end)
                raise ImageError(f"{path} is not a regular file")
            size = status.st_size
            if size > limits.max_bytes:
                raise ImageError(f"the image is over {limits.max_bytes} bytes")
            return path.read_bytes()
        except OSError as error:
            raise ImageError(f"cannot read {path}: {error.strerror}") from None
    if scheme in ("http", "https"):
        raise ImageError("this server fetches nothing from the network: send the image as a data URL")
    raise ImageError("an image URL must be a data: URL (or a file: URL when the server allows them)")


def decode_image(raw: bytes, limits: ImageLimits, pixels_before: int = 0) -> DecodedImage:
    """Encoded image bytes (PNG, JPEG, GIF, WebP, BMP, ...) -> RGB pixels and digest.
    Its size is checked against the limits before anything is decoded."""
    from PIL import Image, UnidentifiedImageError

    if len(raw) > limits.max_bytes:
        raise ImageError(f"the image is over {limits.max_bytes} bytes")
    try:
        with Image.open(io.BytesIO(raw)) as image:
            width, height = image.size
            if width * height > limits.max_pixels:
                raise ImageError(f"the image is {width} x {height} pixels, over {limits.max_pixels}")
            if pixels_before + width * height > limits.max_request_pixels:
                raise ImageError(f"the request's images are over {limits.max_request_pixels} pixels in all")
            image.seek(0)
            rgb = to_rgb(image)
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError("the image cannot be decoded: not an image format this server reads") from None
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as error:
        raise ImageError(f"the image cannot be decoded: {error}") from None
    pixels = torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()
    return DecodedImage(pixels, pixel_digest(pixels))


def to_rgb(image):
    """RGB as the released processor converts: transparency laid on white, other modes converted."""
    from PIL import Image

    if image.mode == "RGB":
        return image.copy()
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def pixel_digest(pixels: torch.Tensor) -> bytes:
    """16 bytes naming ``pixels`` [3, H, W] uint8: its shape and every value."""
    h = hashlib.blake2b(digest_size=16, person=b"v41-image")
    h.update(np.asarray(pixels.shape, dtype="<i8").tobytes())
    h.update(pixels.contiguous().numpy().tobytes())
    return h.digest()
