"""Number formats of DeepSeek V4.1: block-scaled FP8 / FP4, as real bytes and as fake-quant.

Two families live here, both pure tensor math (no I/O, device-agnostic, vectorised):

Cache formats (``BlockFormat``): a vector's last dimension is cut into blocks of ``block``
values; each block stores one scale byte and one element per value (FP8) or per half byte
(FP4). The three cache formats of the model, and the bytes one vector costs:

=================  ========  =====  ======  =======================================
constant           element   block  scale   512 / 128 values
=================  ========  =====  ======  =======================================
``WINDOW_KV``      e4m3      32     ue8m0   512 -> 512 B + 16 B = 528 B
``COMPRESSED_KV``  e2m1      16     e4m3    512 -> 256 B + 32 B = 288 B
``INDEXER_KEY``    e2m1      32     ue8m0   128 ->  64 B +  4 B =  68 B
=================  ========  =====  ======  =======================================

Scale rules (they decide the numbers, so they are part of the contract; they match the
quantise-then-dequantise of the released reference value for value):

* e4m3 elements, ue8m0 scale: ``2^ceil(log2(max(amax, 1e-4) * (1/448)))``.
* e2m1 elements, ue8m0 scale: ``2^ceil(log2(max(amax, 6*2^-126) * (1/6)))``.
* e2m1 elements, e4m3 scale: ``e4m3(max(amax, 6*2^-9) / 6)`` (round to nearest even; torch's
  cast saturates at 448, so blocks with amax above ~2,780 clip).

The block is divided by its scale, clamped to the element range (+-448 / +-6), and rounded
to nearest-even on the element grid.

Checkpoint weight formats (released ``quantization_config``: ``quant_method "fp8"``,
``weight_block_size [32, 32]``, ``scale_fmt "ue8m0"``, ``expert_dtype "fp4"``):

* dense matrices: ``F8_E4M3 [out, in]`` + ``.scale F8_E8M0 [ceil(out/32), ceil(in/32)]``,
  value = fp8 * scale (the scale multiplies; it is not an inverse despite HF's
  ``weight_scale_inv`` name);
* routed experts (MXFP4): ``I8 [out, in/2]``, two e2m1 codes per byte, the even column in the
  low nibble, + ``.scale F8_E8M0 [out, in/32]``;
* Engram rows: ``F8_E4M3 [rows, 256]`` + ``.scale F8_E8M0 [rows, 8]``, i.e. ``ENGRAM_ROW``
  (the ``WINDOW_KV`` layout) applied to each row.

Byte conventions: a UE8M0 scale byte is the biased exponent (``float8_e8m0fnu`` bits: value
``2^(byte-127)``, 255 = NaN); an E4M3 byte is the ``float8_e4m3fn`` bit pattern; an E2M1 code
is ``sign<<3 | exponent<<1 | mantissa``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Element = Literal["e4m3", "e2m1"]
ScaleKind = Literal["ue8m0", "e4m3"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest float4_e2m1fn

# Value of each e2m1 code 0..15 (bit 3 is the sign; code 8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Floors on a block's absolute maximum, so an all-zero block still gets a finite scale.
_AMAX_FLOOR = {("e4m3", "ue8m0"): 1e-4, ("e2m1", "ue8m0"): FP4_MAX * 2.0**-126, ("e2m1", "e4m3"): FP4_MAX * 2.0**-9}


# ----------------------------------------------------------------------------------------
# Scalar codecs, elementwise on tensors
# ----------------------------------------------------------------------------------------


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(t))`` for positive normal float32 ``t``, exactly (read off the IEEE bits:
    a power of two keeps its exponent, anything above it moves up one)."""
    bits = t.to(torch.float32).contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.exp2((exponent - 127).to(torch.float32))


def encode_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Biased-exponent byte of a positive normal power of two (float32). Shape kept, uint8."""
    bits = scale.to(torch.float32).contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF).to(torch.uint8)


def decode_ue8m0(byte: torch.Tensor) -> torch.Tensor:
    """``2^(byte-127)`` as float32 (byte 255 -> NaN, as in ``float8_e8m0fnu``)."""
    exponent = byte.to(torch.int32)
    value = torch.exp2((exponent - 127).to(torch.float32))
    return torch.where(exponent == 255, torch.full_like(value, float("nan")), value)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to nearest-even e4m3 and return its bit pattern (uint8). Values beyond
    +-448 saturate (torch's cast)."""
    return x.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(byte: torch.Tensor) -> torch.Tensor:
    """float32 value of e4m3 bit patterns (0x7F / 0xFF are NaN)."""
    return byte.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Clamp float32 to +-6 and round to nearest-even on the e2m1 grid; returns codes (uint8,
    sign in bit 3, one code per value). NaN input is undefined.

    The grid spacing is 0.5 below 2, 1 below 4 and 2 up to 6; dividing by the (power of two)
    spacing is exact, and ``torch.round`` breaks ties to the even quotient, which is the
    even mantissa: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    """
    x = x.to(torch.float32)
    magnitude = x.abs().clamp(max=FP4_MAX)
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    value = torch.round(magnitude / step) * step
    code = torch.where(value < 2.0, value * 2.0, torch.where(value < 4.0, value + 2.0, value * 0.5 + 4.0))
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(code: torch.Tensor) -> torch.Tensor:
    """float32 value of e2m1 codes (low 4 bits used)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    return table[(code & 0x0F).long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` 4-bit codes -> ``[..., n/2]`` bytes, element ``2i`` in the low nibble
    (the layout of ``torch.float4_e2m1fn_x2`` and of the released expert weights)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of 4-bit codes ({codes.shape[-1]})")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``[..., m]`` bytes (uint8 or int8) -> ``[..., 2m]`` codes."""
    packed = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed.to(torch.uint8)
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------
# Block formats of the caches
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Packed:
    """Real bytes of block-quantised vectors: ``data`` uint8 ``[..., n]`` (e4m3) or
    ``[..., n/2]`` (e2m1, two codes per byte), ``scales`` uint8 ``[..., n/block]``."""

    data: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held, payload plus scales."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


@dataclass(frozen=True)
class BlockFormat:
    """One scale per ``block`` consecutive values along the last dimension.

    ``quantize`` needs the last dimension to be a multiple of ``block`` (ValueError
    otherwise); ``fake_quant`` leaves such tensors untouched, as the reference does for
    shapes it cannot block.
    """

    element: Element
    block: int
    scale: ScaleKind

    def __post_init__(self) -> None:
        if (self.element, self.scale) not in _AMAX_FLOOR:
            raise ValueError(f"unsupported block format: {self.element} elements with {self.scale} scales")
        if self.block <= 0 or self.block % 2:
            raise ValueError(f"block must be a positive even number, got {self.block}")

    def payload_bytes(self, n_values: int) -> int:
        """Bytes of one vector's codes (its scales follow them)."""
        self._check_length(n_values)
        return n_values if self.element == "e4m3" else n_values // 2

    def nbytes(self, n_values: int) -> int:
        """Bytes of one vector of ``n_values``: payload + one byte per block."""
        return self.payload_bytes(n_values) + n_values // self.block

    def for_width(self, n_values: int) -> "BlockFormat | RawFormat":
        """The format a cache stores vectors of ``n_values`` in: this one, or float32 when
        the width is not a multiple of the block (the reference leaves such vectors
        unquantised; only small test configs have them)."""
        return self if n_values % self.block == 0 else RAW_F32

    def block_scales(self, x: torch.Tensor) -> torch.Tensor:
        """float32 scales ``[..., n/block]`` of ``x`` ``[..., n]`` (the rule in the module doc)."""
        self._check_length(x.shape[-1])
        blocks = x.to(torch.float32).unflatten(-1, (-1, self.block))
        amax = blocks.abs().amax(-1).clamp_min(_AMAX_FLOOR[(self.element, self.scale)])
        if self.scale == "e4m3":
            return decode_e4m3(encode_e4m3(amax / FP4_MAX))
        # The reference multiplies by the rounded reciprocal; for normal amax this picks the
        # same power of two as dividing (checked over whole binades), and it is kept as is.
        return pow2_ceil(amax * (1.0 / (FP8_MAX if self.element == "e4m3" else FP4_MAX)))

    def quantize(self, x: torch.Tensor) -> Packed:
        """Bytes of ``x`` ``[..., n]`` (any float dtype; computed in float32)."""
        scale = self.block_scales(x)  # [..., n/block]
        blocks = x.to(torch.float32).unflatten(-1, (-1, self.block)) / scale.unsqueeze(-1)
        if self.element == "e4m3":
            data = encode_e4m3(blocks.clamp(-FP8_MAX, FP8_MAX)).flatten(-2)
        else:
            data = pack_nibbles(encode_e2m1(blocks).flatten(-2))
        scale_bytes = encode_ue8m0(scale) if self.scale == "ue8m0" else encode_e4m3(scale)
        return Packed(data=data, scales=scale_bytes)

    def dequantize(self, packed: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values ``[..., n]`` of ``packed`` (float32 math, then cast to ``dtype``)."""
        if self.element == "e4m3":
            values = decode_e4m3(packed.data)
        else:
            values = decode_e2m1(unpack_nibbles(packed.data))
        scale = decode_ue8m0(packed.scales) if self.scale == "ue8m0" else decode_e4m3(packed.scales)
        if values.shape[-1] != scale.shape[-1] * self.block:
            raise ValueError(f"{values.shape[-1]} values do not match {scale.shape[-1]} scales of block {self.block}")
        out = values.unflatten(-1, (-1, self.block)) * scale.unsqueeze(-1)
        return out.flatten(-2).to(dtype)

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(x))`` in ``x``'s dtype; ``x`` itself when its last dimension
        is not a multiple of ``block`` (tiny configs run those vectors unquantised)."""
        if x.shape[-1] % self.block:
            return x
        return self.dequantize(self.quantize(x), dtype=x.dtype)

    def _check_length(self, n_values: int) -> None:
        if n_values % self.block:
            raise ValueError(f"{n_values} values are not a multiple of the block size {self.block} ({self})")


@dataclass(frozen=True)
class RawFormat:
    """Vectors kept as their float32 bytes, with :class:`BlockFormat`'s interface (no scales)."""

    element: str = "f32"
    block: int = 1
    scale: str = "none"

    def payload_bytes(self, n_values: int) -> int:
        return 4 * n_values

    def nbytes(self, n_values: int) -> int:
        return 4 * n_values

    def quantize(self, x: torch.Tensor) -> Packed:
        data = x.to(torch.float32).contiguous().view(torch.uint8)
        return Packed(data=data, scales=data.new_empty(*data.shape[:-1], 0))

    def dequantize(self, packed: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        data = packed.data.contiguous()
        if data.storage_offset() % 4:  # a float32 view needs aligned bytes
            data = data.clone()
        return data.view(torch.float32).to(dtype)

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        return x


RAW_F32 = RawFormat()
"""Cache vectors a block format cannot block (widths that are not a multiple of its block)."""
WINDOW_KV = BlockFormat("e4m3", 32, "ue8m0")
"""Sliding-window KV of every layer (whole post-RoPE vector, RoPE tail included)."""
COMPRESSED_KV = BlockFormat("e2m1", 16, "e4m3")
"""Long-range (compressed) KV entries of the KV-source layers."""
INDEXER_KEY = BlockFormat("e2m1", 32, "ue8m0")
"""Indexer keys (and, as fake-quant, indexer queries)."""
ENGRAM_ROW = BlockFormat("e4m3", 32, "ue8m0")
"""Rows of the Engram tables in the checkpoint (``engram.embed.weight`` / ``.scale``)."""
EXPERT_FP4 = BlockFormat("e2m1", 32, "ue8m0")
"""Rows of the routed-expert weights in the checkpoint (MXFP4 along the input dimension)."""


# ----------------------------------------------------------------------------------------
# Checkpoint weights
# ----------------------------------------------------------------------------------------


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales from checkpoint storage: uint8 / ``float8_e8m0fnu`` are UE8M0 bytes,
    float tensors are taken as values (the float32 ``weight_scale_inv`` of other exports)."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return decode_ue8m0(scale)
    return scale.to(torch.float32)


def _weight_bytes(weight: torch.Tensor) -> torch.Tensor:
    """uint8 view of byte-sized storage (uint8, int8, float8, float4 x2)."""
    if weight.element_size() != 1:
        raise ValueError(f"expected a byte-sized weight tensor, got {weight.dtype}")
    return weight.view(torch.uint8)


def dequantize_fp8_weight(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (32, 32)
) -> torch.Tensor:
    """Dense FP8 weight -> float32 ``[out, in]``.

    ``weight``: ``[out, in]`` float8_e4m3fn or its uint8 bits. ``scale``: ``[ceil(out/b0),
    ceil(in/b1)]`` UE8M0 (uint8 / float8_e8m0fnu) or float; each entry multiplies its
    ``b0 x b1`` tile (edge tiles are cut).
    """
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // block[0]), -(-in_dim // block[1])
    if tuple(scale.shape) != (rows, cols):
        raise ValueError(f"scale {tuple(scale.shape)} does not tile weight {tuple(weight.shape)} in {block} blocks")
    values = decode_e4m3(_weight_bytes(weight))
    tiles = _scale_values(scale).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return values * tiles[:out_dim, :in_dim]


def quantize_fp8_weight(
    weight: torch.Tensor, block: tuple[int, int] = (32, 32)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`dequantize_fp8_weight`, in the released storage dtypes.

    Returns ``(float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/b0), ceil(in/b1)])``; each
    tile's scale is ``2^ceil(log2(max(amax, 1e-4) / 448))`` (ue8m0, as ``WINDOW_KV``).
    """
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // block[0]), -(-in_dim // block[1])
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32, device=weight.device)
    padded[:out_dim, :in_dim] = weight.to(torch.float32)
    tiles = padded.view(rows, block[0], cols, block[1])  # [R, b0, C, b1]
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(_AMAX_FLOOR[("e4m3", "ue8m0")])
    scale = pow2_ceil(amax * (1.0 / FP8_MAX))  # [R, C]
    codes = encode_e4m3((tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX))
    codes = codes.view(rows * block[0], cols * block[1])[:out_dim, :in_dim].contiguous()
    return codes.view(torch.float8_e4m3fn), encode_ue8m0(scale).view(torch.float8_e8m0fnu)


def dequantize_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Routed-expert FP4 weight -> float32 ``[out, in]``.

    ``packed``: ``[out, in/2]`` int8 / uint8 / float4_e2m1fn_x2 (even column in the low
    nibble). ``scale``: ``[out, in/block]`` UE8M0 (uint8 / float8_e8m0fnu) or float.
    """
    values = decode_e2m1(unpack_nibbles(_weight_bytes(packed)))  # [out, in]
    scales = _scale_values(scale)
    if values.shape[-1] != scales.shape[-1] * block or values.shape[0] != scales.shape[0]:
        raise ValueError(f"scale {tuple(scale.shape)} does not match weight {tuple(values.shape)} in blocks of {block}")
    return (values.unflatten(-1, (-1, block)) * scales.unsqueeze(-1)).flatten(-2)


def quantize_fp4_weight(weight: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`dequantize_fp4_weight`, in the released storage dtypes.

    Returns ``(int8 [out, in/2], float8_e8m0fnu [out, in/block])``, scales as ``INDEXER_KEY``
    (``2^ceil(log2(amax / 6))``). ``in`` must be a multiple of ``block``.
    """
    packed = BlockFormat("e2m1", block, "ue8m0").quantize(weight)
    return packed.data.view(torch.int8), packed.scales.view(torch.float8_e8m0fnu)
