"""The vision input path: image preprocessing, DeepSeek-ViT, 3x3 merge + aligner, span markers.

pixels [3, H, W] --plan_image / preprocess_image--> patches [n_vit_h * n_vit_w, 3 * 14 * 14]
  --DeepSeekViT--> features [n_vit, 1024] --Aligner (3x3 merge, 2-layer MLP)--> [n_llm, 5120]
  --VisionTower.span--> [image_start] + ([tokens of a row] + [image_newline]) * n_llm_h + [image_end]

Preprocessing (pure tensor math, the plan of the released image processor):

1. upscale (aspect kept) until the area is at least ``min_pixels`` (544 x 544);
2. round both sides up to whole 14-pixel patches: that is the planned box;
3. if the box costs more than ``max_image_tokens`` text tokens (``n_llm_h * (n_llm_w + 1) + 2``:
   the row newline markers and the start / end markers count), shrink it with the closed-form
   largest aspect-kept size that fits;
4. fit the image inside the box (aspect kept, one side exact), centre it and pad the rest
   with grey (127 of 255); rescale to [0, 1] and normalise with mean 0.5, std 0.5;
5. cut 14 x 14 patches in row-major order, each flattened channel-major ``(c, py, px)``.

DeepSeek-ViT (every patch sees every patch of its image, no mask): a linear patch layer
(588 -> 1024, with bias), then ``num_hidden_layers`` pre-norm blocks (RMSNorm, eps 1e-6)
of attention (fused ``wqkv`` with bias, 16 heads of 64, 2D RoPE, ``wo`` with bias) and a
SwiGLU MLP (fused ``w1`` = gate rows then up rows, 1024 -> 2 x 2816; ``w2`` 2816 -> 1024,
no biases), then a final RMSNorm. 2D RoPE rotates the whole head in pairs
``(i, i + head_dim / 2)``; the first quarter of the pair angles follow the patch row, the
second quarter the patch column, with inverse frequencies ``theta ** (-2j / (head_dim / 2))``.

Aligner: each 3 x 3 block of patch features (zero-padded at the ragged bottom / right edge)
is unfolded channel-major into 9 x 1024 = 9216 numbers (column ``c * 9 + dy * 3 + dx``),
then ``w2(gelu(w1(x)))`` with exact (erf) GELU, both layers with bias, width = the text
hidden size.

Parameter names are the released checkpoint's top-level names, verbatim, when the
:class:`VisionTower`'s children sit at the root of the full model:
``vision.patch_embed.proj.{weight,bias}``, ``vision.blocks.N.{norm1,norm2}.weight``,
``vision.blocks.N.attn.{wqkv,wo}.{weight,bias}``, ``vision.blocks.N.mlp.{w1,w2}.weight``,
``vision.norm.weight``, ``aligner.{w1,w2}.{weight,bias}``, ``image_start``, ``image_end``,
``image_newline`` (each ``[text hidden]``). Sources: the release's tensor inventory
(266 vision tensors: ``mlp.w1`` [5632, 1024], ``aligner.w1`` [5120, 9216], ``aligner.w2``
[5120, 5120]) as listed by public ports, and the Hugging Face reference, which skips
``vision.*``, ``aligner.*`` and ``image_(start|end|newline)`` on load.

Choices not pinned by a released name or shape (see the module report): the order of the
two halves of the fused ``mlp.w1`` (gate first), no SwiGLU clamp in the ViT, the resize
filter (bicubic with antialias, rounded to 8-bit like an image library would).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import TextConfig, VisionConfig
from .norm import RMSNorm

# The released image processor's normalisation and padding (not config keys).
PAD_VALUE = 127
IMAGE_MEAN = 0.5
IMAGE_STD = 0.5


# ---------------------------------------------------------------------- preprocessing


def num_image_tokens(llm_h: int, llm_w: int) -> int:
    """Text positions one image takes: its token grid, a newline per row, start and end."""
    return llm_h * (llm_w + 1) + 2


@dataclass(frozen=True)
class ImagePlan:
    """Where an image of ``source`` size lands.

    ``height`` x ``width`` is the padded box (whole patches); the resized content is
    ``content_height`` x ``content_width`` placed at (``top``, ``left``); ``vit_h`` x
    ``vit_w`` the patch grid; ``llm_h`` x ``llm_w`` the aligner's token grid.
    """

    source_height: int
    source_width: int
    height: int
    width: int
    content_height: int
    content_width: int
    top: int
    left: int
    vit_h: int
    vit_w: int
    llm_h: int
    llm_w: int

    @property
    def num_tokens(self) -> int:
        return num_image_tokens(self.llm_h, self.llm_w)


def _token_grid(box_h: int, box_w: int, patch: int, merge: int) -> tuple[int, int]:
    return math.ceil((box_h // patch) / merge), math.ceil((box_w // patch) / merge)


def _fit_box(height: int, width: int, patch: int, merge: int, max_tokens: int) -> tuple[int, int]:
    """Largest aspect-kept box (whole patches) whose token grid fits ``max_tokens``.

    With ``n_h = aspect * n_w`` the cost ``n_h * (n_w + 1) + 2 <= max_tokens`` is a
    quadratic in ``n_w``; its root, floored per side, scales the image.
    """
    aspect = height / width
    n_w = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    n_h = n_w * aspect
    cell = patch * merge
    if n_w < 1.0:  # very tall: one column of tokens
        return (max_tokens - 2) // 2 * cell, cell
    if n_h < 1.0:  # very wide: one row of tokens
        return cell, (max_tokens - 3) * cell
    scale = min(math.floor(n_w) * cell / width, math.floor(n_h) * cell / height)
    return math.floor(height * scale / patch) * patch, math.floor(width * scale / patch) * patch


def plan_image(height: int, width: int, config: VisionConfig) -> ImagePlan:
    """The resize / pad plan for an image of ``height`` x ``width`` pixels."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height} x {width}")
    patch, merge, max_tokens = config.patch_size, config.downsample_ratio, config.max_image_tokens
    if max_tokens < 4:
        raise ValueError("max_image_tokens must be at least 4")
    h, w = height, width
    if config.max_wh_ratio is not None and w > h * config.max_wh_ratio:
        w = h * config.max_wh_ratio
    if h * w < config.min_pixels:
        grow = math.sqrt(config.min_pixels / (h * w))
        h, w = int(h * grow), int(w * grow)
    box_h, box_w = math.ceil(h / patch) * patch, math.ceil(w / patch) * patch
    if num_image_tokens(*_token_grid(box_h, box_w, patch, merge)) > max_tokens:
        box_h, box_w = _fit_box(h, w, patch, merge, max_tokens)
        if num_image_tokens(*_token_grid(box_h, box_w, patch, merge)) > max_tokens:
            raise ValueError(f"a {height} x {width} image cannot fit in {max_tokens} image tokens")
    squeeze = config.max_wh_ratio is not None and width >= config.max_wh_ratio * height
    if squeeze:  # very wide: stretched into the box, aspect not kept
        content_h, content_w = box_h, box_w
    elif width / height > box_w / box_h:
        content_h, content_w = round(height / width * box_w), box_w
    elif width / height < box_w / box_h:
        content_h, content_w = box_h, round(width / height * box_h)
    else:
        content_h, content_w = box_h, box_w
    llm_h, llm_w = _token_grid(box_h, box_w, patch, merge)
    return ImagePlan(
        source_height=height,
        source_width=width,
        height=box_h,
        width=box_w,
        content_height=content_h,
        content_width=content_w,
        top=round((box_h - content_h) * 0.5),
        left=round((box_w - content_w) * 0.5),
        vit_h=box_h // patch,
        vit_w=box_w // patch,
        llm_h=llm_h,
        llm_w=llm_w,
    )


def resize_and_pad(image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
    """``image`` [3, H, W] with values in 0..255 -> [3, plan.height, plan.width] fp32, grey-padded.

    Bicubic with antialias, rounded and clamped to 8-bit values like an image library.
    """
    if image.shape[-2:] != (plan.source_height, plan.source_width):
        raise ValueError(f"image is {tuple(image.shape[-2:])}, the plan is for {plan.source_height} x {plan.source_width}")
    x = image.float().unsqueeze(0)
    if (plan.content_height, plan.content_width) != tuple(x.shape[-2:]):
        x = F.interpolate(
            x, size=(plan.content_height, plan.content_width), mode="bicubic", align_corners=False, antialias=True
        )
        x = x.round().clamp(0, 255)
    bottom = plan.height - plan.content_height - plan.top
    right = plan.width - plan.content_width - plan.left
    return F.pad(x, (plan.left, right, plan.top, bottom), value=float(PAD_VALUE))[0]


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[C, H, W] -> [H/p * W/p, C * p * p]: row-major patches, each flattened channel-major."""
    c, h, w = pixels.shape
    if h % patch or w % patch:
        raise ValueError(f"{h} x {w} is not a whole number of {patch}-pixel patches")
    grid = pixels.reshape(c, h // patch, patch, w // patch, patch).permute(1, 3, 0, 2, 4)
    return grid.reshape((h // patch) * (w // patch), c * patch * patch)


def preprocess_image(image: torch.Tensor, config: VisionConfig) -> tuple[torch.Tensor, ImagePlan]:
    """``image`` [3, H, W] (uint8 or 0..255 floats) -> (patches [n_vit, 3 * p * p] fp32, plan)."""
    if image.ndim != 3 or image.shape[0] != config.num_channels:
        raise ValueError(f"expected an image [{config.num_channels}, H, W], got {tuple(image.shape)}")
    plan = plan_image(image.shape[1], image.shape[2], config)
    pixels = (resize_and_pad(image, plan) / 255.0 - IMAGE_MEAN) / IMAGE_STD
    return patchify(pixels, config.patch_size), plan


# ---------------------------------------------------------------------- 2D RoPE


def rope_2d(rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., head_dim / 2] for patches at (``rows``, ``cols``) [...].

    Angle ``j`` is ``row * f_j`` for the first ``head_dim / 4`` pairs and ``col * f_j``
    for the rest, ``f_j = theta ** (-2j / (head_dim / 2))``.
    """
    if head_dim % 4:
        raise ValueError("2D RoPE needs a head_dim divisible by 4")
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=rows.device) / half)
    angles = torch.cat((rows.float().unsqueeze(-1) * inv_freq, cols.float().unsqueeze(-1) * inv_freq), dim=-1)
    return angles.cos(), angles.sin()


def grid_rope(vit_h: int, vit_w: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [vit_h * vit_w, head_dim / 2] for a row-major patch grid."""
    rows = torch.arange(vit_h, device=device).repeat_interleave(vit_w)
    cols = torch.arange(vit_w, device=device).repeat(vit_h)
    return rope_2d(rows, cols, head_dim, theta)


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., n, heads, head_dim] in pairs ``(i, i + head_dim / 2)``; cos/sin [..., n, head_dim / 2]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)


# ---------------------------------------------------------------------- the ViT


class PatchEmbed(nn.Module):
    """A linear layer over flattened patches (a convolution's job, kept linear for Muon)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(config.num_channels * config.patch_size**2, config.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches, 2D RoPE on q and k."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError("vision hidden_size must divide into num_attention_heads")
        self.n_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.n_heads
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [n, d] (one image) -> [n, d]."""
        q, k, v = self.wqkv(x).unflatten(-1, (3, self.n_heads, self.head_dim)).unbind(dim=-3)  # [n, H, hd]
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1)
        )  # [H, n, hd]
        return self.wo(out.transpose(0, 1).flatten(-2).to(x.dtype))


class VisionMLP(nn.Module):
    """SwiGLU with a fused gate/up projection: ``w2(silu(gate) * up)``, ``[gate; up] = w1 x``."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).float().chunk(2, dim=-1)
        return self.w2((F.silu(gate) * up).to(x.dtype))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class DeepSeekViT(nn.Module):
    """Patches of one image [n_vit, 3 * p * p] -> features [n_vit, hidden]."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        if patches.shape[0] != vit_h * vit_w:
            raise ValueError(f"{patches.shape[0]} patches for a {vit_h} x {vit_w} grid")
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        cos, sin = grid_rope(vit_h, vit_w, head_dim, self.config.rope_theta, patches.device)
        x = self.patch_embed(patches.to(self.patch_embed.proj.weight.dtype))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


# ---------------------------------------------------------------------- merge + aligner


def merge_patches(features: torch.Tensor, vit_h: int, vit_w: int, ratio: int) -> torch.Tensor:
    """[vit_h * vit_w, d] -> [llm_h * llm_w, d * ratio^2]: each ratio x ratio block unfolded.

    Column ``c * ratio^2 + dy * ratio + dx`` holds channel ``c`` of the patch at
    (``dy``, ``dx``) inside the block; blocks past the grid's edge are zeros.
    """
    d = features.shape[-1]
    llm_h, llm_w = math.ceil(vit_h / ratio), math.ceil(vit_w / ratio)
    grid = features.reshape(vit_h, vit_w, d)
    grid = F.pad(grid, (0, 0, 0, llm_w * ratio - vit_w, 0, llm_h * ratio - vit_h))
    blocks = grid.reshape(llm_h, ratio, llm_w, ratio, d).permute(0, 2, 4, 1, 3)  # [lh, lw, d, dy, dx]
    return blocks.reshape(llm_h * llm_w, d * ratio * ratio)


class Aligner(nn.Module):
    """The 2-layer MLP from merged patch blocks (9 x 1024) to the text width."""

    def __init__(self, vision: VisionConfig, text_hidden: int):
        super().__init__()
        self.ratio = vision.downsample_ratio
        self.w1 = nn.Linear(vision.hidden_size * self.ratio**2, text_hidden)
        self.w2 = nn.Linear(text_hidden, text_hidden)

    def forward(self, features: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """ViT features [vit_h * vit_w, d] -> image tokens [llm_h * llm_w, text_hidden] (row-major)."""
        merged = merge_patches(features, vit_h, vit_w, self.ratio)
        return self.w2(F.gelu(self.w1(merged).float()).to(merged.dtype))


class VisionTower(nn.Module):
    """ViT + aligner + the learned span markers: patches of one image -> its span embeddings.

    ``named_parameters()`` gives the released names (``vision.*``, ``aligner.*``,
    ``image_start``, ``image_end``, ``image_newline``).
    """

    def __init__(self, vision_config: VisionConfig, text_config: TextConfig):
        super().__init__()
        self.config = vision_config
        self.vision = DeepSeekViT(vision_config)
        self.aligner = Aligner(vision_config, text_config.hidden_size)
        self.image_start = nn.Parameter(torch.zeros(text_config.hidden_size))
        self.image_end = nn.Parameter(torch.zeros(text_config.hidden_size))
        self.image_newline = nn.Parameter(torch.zeros(text_config.hidden_size))

    def grid(self, vit_h: int, vit_w: int) -> tuple[int, int]:
        """The token grid (llm_h, llm_w) of a vit_h x vit_w patch grid."""
        r = self.config.downsample_ratio
        return math.ceil(vit_h / r), math.ceil(vit_w / r)

    def encode(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """Patches [vit_h * vit_w, 3 * p * p] -> image tokens [llm_h * llm_w, text_hidden] (fp32)."""
        return self.aligner(self.vision(patches, vit_h, vit_w), vit_h, vit_w).float()

    def span(self, tokens: torch.Tensor, llm_h: int, llm_w: int) -> torch.Tensor:
        """Image tokens [llm_h * llm_w, D] -> the span [num_image_tokens(llm_h, llm_w), D]."""
        rows = tokens.reshape(llm_h, llm_w, -1)
        newline = self.image_newline.to(rows.dtype).expand(llm_h, 1, -1)
        body = torch.cat((rows, newline), dim=1).flatten(0, 1)
        return torch.cat((self.image_start.to(rows.dtype)[None], body, self.image_end.to(rows.dtype)[None]))

    def span_of(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """:meth:`forward` with gradients (training)."""
        return self.span(self.encode(patches, vit_h, vit_w), *self.grid(vit_h, vit_w))

    @torch.no_grad()
    def forward(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """Patches of one image -> the embeddings of its whole span in the text stream (fp32)."""
        return self.span_of(patches, vit_h, vit_w)
