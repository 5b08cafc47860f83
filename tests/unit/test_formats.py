"""model/formats.py against an independent numpy + ml_dtypes oracle.

The oracle below restates the scale rules of the released reference (amax floors, power of
two rounded up, reciprocal multiply, e4m3 scale) with numpy float32 arithmetic and lets
ml_dtypes do every rounding onto an element grid, so the torch code is checked value for
value and bit for bit, not against itself.
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.formats import (
    COMPRESSED_KV,
    E2M1_VALUES,
    ENGRAM_ROW,
    EXPERT_FP4,
    INDEXER_KEY,
    WINDOW_KV,
    BlockFormat,
    Packed,
    decode_e2m1,
    decode_e4m3,
    decode_ue8m0,
    dequantize_fp4_weight,
    dequantize_fp8_weight,
    encode_e2m1,
    encode_e4m3,
    encode_ue8m0,
    pack_nibbles,
    pow2_ceil,
    quantize_fp4_weight,
    quantize_fp8_weight,
    unpack_nibbles,
)

pytestmark = pytest.mark.unit

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CACHE_FORMATS = [WINDOW_KV, COMPRESSED_KV, INDEXER_KEY]


# ----------------------------------------------------------------------------------------
# The oracle
# ----------------------------------------------------------------------------------------


def all_16bit_floats() -> np.ndarray:
    """Every finite bfloat16 and float16 value, as float32."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = np.concatenate([bits.view(ml_dtypes.bfloat16).astype(np.float32), bits.view(np.float16).astype(np.float32)])
    return values[np.isfinite(values)]


def np_pow2_ceil(t: np.ndarray) -> np.ndarray:
    mantissa, exponent = np.frexp(t.astype(np.float64))  # t = mantissa * 2^exponent, mantissa in [0.5, 1)
    return np.ldexp(1.0, np.where(mantissa == 0.5, exponent - 1, exponent)).astype(np.float32)


def oracle_fake_quant(x: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, fmt.block)
    amax = np.abs(blocks).max(-1)
    if fmt.element == "e4m3":
        scale = np_pow2_ceil(np.maximum(amax, np.float32(1e-4)) * np.float32(1 / 448))
    elif fmt.scale == "ue8m0":
        scale = np_pow2_ceil(np.maximum(amax, np.float32(6 * 2.0**-126)) * np.float32(1 / 6))
    else:
        scale = (np.maximum(amax, np.float32(6 * 2.0**-9)) / np.float32(6)).astype(ml_dtypes.float8_e4m3fn)
        scale = scale.astype(np.float32)
    q = blocks / scale[..., None]
    if fmt.element == "e4m3":
        q = np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        q = np.clip(q, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (q * scale[..., None]).reshape(x.shape)


def awkward_vectors(fmt: BlockFormat, n: int, seed: int) -> np.ndarray:
    """``[12, n]`` float32 vectors whose blocks span many magnitudes, hit scale boundaries
    exactly, sit on rounding ties, or are all zero."""
    rng = np.random.default_rng(seed)
    rows, n_blocks = 12, n // fmt.block
    x = rng.standard_normal((rows, n_blocks, fmt.block)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-6, 3, (rows, n_blocks, 1))).astype(np.float32)
    element_max = 448.0 if fmt.element == "e4m3" else 6.0
    if fmt.element == "e4m3":
        grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        grid = np.unique(np.abs(grid[np.isfinite(grid)]))
    else:
        grid = np.array(E2M1_VALUES[:8], np.float32)
    ties = (grid[:-1] + grid[1:]) / 2
    for r in range(3, rows):  # tie blocks: amax = element_max * 2^k exactly, the rest on midpoints
        for b in range(n_blocks):
            k = int(rng.integers(-8, 4))
            if fmt.scale == "e4m3":
                k = 0  # the e4m3 scale of amax/6 is then exactly 2^0
            values = rng.choice(ties, fmt.block) * rng.choice([-1.0, 1.0], fmt.block)
            values[rng.integers(fmt.block)] = element_max
            x[r, b] = (values * 2.0**k).astype(np.float32)
    x[0, 0] = 0.0  # all-zero block
    x[1, 0] = np.float32(1e-30)  # tiny block, below the amax floors
    x[2, :, 0] = np.float32(element_max * 2.0**3)  # amax on a power-of-two boundary
    if fmt.scale == "e4m3":
        x = np.clip(x, -2000, 2000)  # torch saturates the e4m3 scale where ml_dtypes gives NaN
    return x.reshape(rows, n).astype(np.float32)


# ----------------------------------------------------------------------------------------
# Scalar codecs
# ----------------------------------------------------------------------------------------


def test_e2m1_rounding_matches_ml_dtypes_on_every_16bit_float():
    x = all_16bit_floats()
    expected = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    got = encode_e2m1(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, expected)


def test_e2m1_rounding_on_ties_and_random_float32():
    rng = np.random.default_rng(0)
    grid = np.array(E2M1_VALUES[:8], np.float32)
    ties = (grid[:-1] + grid[1:]) / 2
    near = np.concatenate([ties, np.nextafter(ties, 0), np.nextafter(ties, 7), grid, [6.5, 1e9]]).astype(np.float32)
    x = np.concatenate([near, -near, rng.uniform(-7, 7, 200_000).astype(np.float32)])
    expected = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(encode_e2m1(torch.from_numpy(x)).numpy(), expected)


def test_e2m1_codes_decode_like_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = decode_e2m1(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))  # -0 included
    np.testing.assert_array_equal(encode_e2m1(torch.from_numpy(got)).numpy(), codes)


def test_e4m3_rounding_matches_ml_dtypes_on_every_16bit_float():
    x = all_16bit_floats()
    x = x[np.abs(x) <= 448]  # beyond it torch saturates and ml_dtypes overflows; callers clamp
    expected = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(encode_e4m3(torch.from_numpy(x)).numpy(), expected)


def test_every_e4m3_code_round_trips():
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = decode_e4m3(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(got, expected)  # NaN == NaN for assert_array_equal
    finite = np.isfinite(got)
    np.testing.assert_array_equal(encode_e4m3(torch.from_numpy(got[finite])).numpy(), codes[finite])


def test_pow2_ceil_and_ue8m0_bytes():
    rng = np.random.default_rng(1)
    x = all_16bit_floats()
    powers = np.ldexp(np.float32(1), np.arange(-126, 128)).astype(np.float32)
    random_bits = rng.integers(0x00800000, 0x7E800000, 500_000, dtype=np.int64).astype(np.uint32).view(np.float32)
    t = np.concatenate([x[(x >= np.float32(2.0**-126)) & (x <= np.float32(2.0**127))], powers, np.nextafter(powers, 0)[1:], np.nextafter(powers, np.inf)[:-1], random_bits])
    np.testing.assert_array_equal(pow2_ceil(torch.from_numpy(t)).numpy(), np_pow2_ceil(t))

    scales = torch.from_numpy(powers)
    expected = powers.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    np.testing.assert_array_equal(encode_ue8m0(scales).numpy(), expected)
    all_bytes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(
        decode_ue8m0(torch.from_numpy(all_bytes)).numpy(), all_bytes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    )


def test_nibble_packing_round_trips_with_the_even_value_low():
    codes = torch.randint(0, 16, (5, 3, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (5, 3, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes)
    assert torch.equal(unpack_nibbles(packed.view(torch.int8)), codes)
    assert pack_nibbles(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21
    with pytest.raises(ValueError):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


# ----------------------------------------------------------------------------------------
# Cache formats
# ----------------------------------------------------------------------------------------


def test_byte_sizes_of_the_full_size_vectors():
    assert WINDOW_KV.nbytes(512) == 528
    assert COMPRESSED_KV.nbytes(512) == 288
    assert INDEXER_KEY.nbytes(128) == 68
    for fmt, n in [(WINDOW_KV, 512), (COMPRESSED_KV, 512), (INDEXER_KEY, 128)]:
        packed = fmt.quantize(torch.randn(n))
        assert packed.data.dtype == packed.scales.dtype == torch.uint8
        assert packed.nbytes == fmt.nbytes(n)
        assert packed.scales.shape == (n // fmt.block,)


def test_long_range_bytes_per_token_is_890():
    # Encoder: 3 KV sources pooling 2 tokens per entry; decoder: 1 source, 1 entry per token;
    # one indexer key per entry of each cache.
    per_token = 3 * COMPRESSED_KV.nbytes(512) / 2 + COMPRESSED_KV.nbytes(512)
    per_token += 3 * INDEXER_KEY.nbytes(128) / 2 + INDEXER_KEY.nbytes(128)
    assert per_token == 890


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", CACHE_FORMATS, ids=lambda f: f"{f.element}-{f.block}-{f.scale}")
def test_fake_quant_matches_the_oracle_value_for_value(fmt, device):
    n = 128 if fmt is INDEXER_KEY else 512
    x = awkward_vectors(fmt, n, seed=fmt.block)
    got = fmt.fake_quant(torch.from_numpy(x).to(device)).cpu().numpy()
    np.testing.assert_array_equal(got, oracle_fake_quant(x, fmt))


@pytest.mark.parametrize("fmt", CACHE_FORMATS, ids=lambda f: f"{f.element}-{f.block}-{f.scale}")
def test_fake_quant_is_dequantize_of_quantize(fmt):
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(2, 3, 256) * 5).to(dtype)
        fake = fmt.fake_quant(x)
        assert fake.dtype == dtype and fake.shape == x.shape
        assert torch.equal(fake, fmt.dequantize(fmt.quantize(x), dtype=dtype))


@pytest.mark.parametrize("fmt", CACHE_FORMATS, ids=lambda f: f"{f.element}-{f.block}-{f.scale}")
def test_dequantize_reads_arbitrary_bytes(fmt):
    rng = np.random.default_rng(3)
    n = 256
    if fmt.element == "e4m3":
        data = rng.integers(0, 256, (6, n), dtype=np.uint8)
        data[(data & 0x7F) == 0x7F] = 0x42  # skip the NaN codes
        values = data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        data = rng.integers(0, 256, (6, n // 2), dtype=np.uint8)
        codes = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(6, n)
        values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    if fmt.scale == "ue8m0":
        scales = rng.integers(100, 150, (6, n // fmt.block), dtype=np.uint8)
        scale_values = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    else:
        scales = rng.integers(0x01, 0x7F, (6, n // fmt.block), dtype=np.uint8)
        scale_values = scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    expected = (values.reshape(6, -1, fmt.block) * scale_values[..., None]).reshape(6, n)
    got = fmt.dequantize(Packed(torch.from_numpy(data), torch.from_numpy(scales)))
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("fmt", [WINDOW_KV, INDEXER_KEY], ids=lambda f: f"{f.element}-{f.block}-{f.scale}")
def test_power_of_two_formats_are_idempotent(fmt):
    # (Not true of e4m3 scales: a requantised block can round its scale differently.)
    once = fmt.fake_quant(torch.from_numpy(awkward_vectors(fmt, 256, seed=7)))
    assert torch.equal(fmt.fake_quant(once), once)


def test_shapes_that_do_not_block():
    x = torch.randn(4, 20)
    for fmt in CACHE_FORMATS:
        assert fmt.fake_quant(x) is x
        with pytest.raises(ValueError):
            fmt.quantize(x)
        with pytest.raises(ValueError):
            fmt.nbytes(20)
    with pytest.raises(ValueError):
        WINDOW_KV.dequantize(Packed(torch.zeros(64, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8)))
    with pytest.raises(ValueError):
        BlockFormat("e4m3", 32, "e4m3")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------
# Checkpoint weights
# ----------------------------------------------------------------------------------------


def oracle_fp8_weight(w: np.ndarray, block: int = 32) -> np.ndarray:
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    padded = np.zeros((rows * block, cols * block), np.float32)
    padded[:out_dim, :in_dim] = w
    tiles = padded.reshape(rows, block, cols, block)
    scale = np_pow2_ceil(np.maximum(np.abs(tiles).max(axis=(1, 3)), np.float32(1e-4)) * np.float32(1 / 448))
    q = np.clip(tiles / scale[:, None, :, None], -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (q * scale[:, None, :, None]).reshape(rows * block, cols * block)[:out_dim, :in_dim]


@pytest.mark.parametrize("shape", [(64, 96), (70, 100)])
def test_fp8_weight_round_trip(shape):
    w = torch.randn(shape) * torch.logspace(-3, 2, shape[1])
    weight, scale = quantize_fp8_weight(w)
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == shape
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (-(-shape[0] // 32), -(-shape[1] // 32))
    expected = oracle_fp8_weight(w.numpy())
    np.testing.assert_array_equal(dequantize_fp8_weight(weight, scale).numpy(), expected)
    # The raw bytes read back the same, and a float scale is taken as the multiplier.
    as_bytes = dequantize_fp8_weight(weight.view(torch.uint8), scale.view(torch.uint8))
    np.testing.assert_array_equal(as_bytes.numpy(), expected)
    np.testing.assert_array_equal(dequantize_fp8_weight(weight, scale.float()).numpy(), expected)
    with pytest.raises(ValueError):
        dequantize_fp8_weight(weight, scale[:, :1])


def test_fp4_weight_nibble_order_and_scale():
    # One row of 32 codes 0..15, 0..15 packed as the release stores them: even column low.
    row = [lo | (hi << 4) for lo, hi in zip(range(0, 16, 2), range(1, 16, 2))] * 2
    packed = torch.tensor([row], dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2.0
    expected = torch.tensor(E2M1_VALUES * 2).view(1, 32) * 2.0
    assert torch.equal(dequantize_fp4_weight(packed, scale), expected)


def test_fp4_weight_round_trip():
    w = torch.randn(48, 128) * 3
    packed, scale = quantize_fp4_weight(w)
    assert packed.dtype == torch.int8 and packed.shape == (48, 64)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (48, 4)
    expected = oracle_fake_quant(w.numpy(), EXPERT_FP4)
    np.testing.assert_array_equal(dequantize_fp4_weight(packed, scale).numpy(), expected)
    with pytest.raises(ValueError):
        dequantize_fp4_weight(packed, scale[:, :2])


def test_engram_rows_read_from_checkpoint_storage():
    rows = torch.randn(10, 256)
    packed = ENGRAM_ROW.quantize(rows)
    weight, scale = packed.data.view(torch.float8_e4m3fn), packed.scales.view(torch.float8_e8m0fnu)
    assert scale.shape == (10, 8)
    expected = weight.float().unflatten(-1, (8, 32)) * scale.float().unsqueeze(-1)
    got = ENGRAM_ROW.dequantize(Packed(weight.view(torch.uint8), scale.view(torch.uint8)))
    assert torch.equal(got, expected.flatten(-2))


def test_quantized_weights_save_in_the_released_dtypes(tmp_path):
    dense, dense_scale = quantize_fp8_weight(torch.randn(64, 64))
    expert, expert_scale = quantize_fp4_weight(torch.randn(64, 64))
    tensors = {
        "layers.0.attn.wq_a.weight": dense,
        "layers.0.attn.wq_a.scale": dense_scale,
        "layers.0.ffn.experts.0.w1.weight": expert,
        "layers.0.ffn.experts.0.w1.scale": expert_scale,
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    assert [header[name]["dtype"] for name in tensors] == ["F8_E4M3", "F8_E8M0", "I8", "F8_E8M0"]
    assert header["layers.0.ffn.experts.0.w1.scale"]["shape"] == [64, 2]
    with safe_open(str(path), framework="pt") as f:
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name).view(torch.uint8), tensor.view(torch.uint8))
