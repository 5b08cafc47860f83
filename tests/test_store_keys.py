"""Keys and envelopes of the tiered store: hash chains, fingerprints, checksums, verification."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import zlib

import numpy as np
import pytest

from storage.codec import HEADER_BYTES, Codec, CorruptObject
from storage.keys import Fingerprint, Kind, MediaSpan, ObjectKey, chunk_keys, window_key

FP = Fingerprint.of("tiny", {"layers": 4, "window": 8})


def test_chunks_of_a_shared_prefix_share_keys() -> None:
    a = list(range(100))
    b = a[:64] + [7] * 36
    ka, kb = chunk_keys(FP, a, 16), chunk_keys(FP, b, 16)
    assert len(ka) == 6  # the partial tail (4 tokens) has no key
    assert ka[:4] == kb[:4] and ka[4] != kb[4]
    assert all(k.kind is Kind.CHUNK and len(k.hex) == 64 for k in ka)
    assert chunk_keys(FP, np.array(a, dtype=np.int32), 16) == ka  # the id dtype does not matter


def test_a_chunk_key_depends_on_its_whole_prefix() -> None:
    a = list(range(32))
    b = [1] + a[1:]
    assert chunk_keys(FP, a, 16)[1] != chunk_keys(FP, b, 16)[1]


def test_two_models_never_share_a_key() -> None:
    other = Fingerprint.of("tiny", {"layers": 4, "window": 16})
    ids = list(range(64))
    assert not set(chunk_keys(FP, ids, 16)) & set(chunk_keys(other, ids, 16))
    assert Fingerprint.of("tiny", {"window": 8, "layers": 4}) == FP  # key order is irrelevant


def test_media_content_enters_the_key() -> None:
    ids = [5] * 32  # image placeholder ids look alike; the pixels must not
    one = chunk_keys(FP, ids, 16, [MediaSpan(20, b"cat")])
    two = chunk_keys(FP, ids, 16, [MediaSpan(20, b"dog")])
    assert one[0] == two[0] and one[1] != two[1]


def test_window_keys_name_the_whole_sequence_and_never_a_chunk() -> None:
    ids = list(range(40))
    w = window_key(FP, ids, 16)
    assert w.kind is Kind.WINDOW
    assert w != window_key(FP, ids[:39], 16) != window_key(FP, [9] + ids[1:], 16)
    assert window_key(FP, ids[:32], 16).digest not in {k.digest for k in chunk_keys(FP, ids, 16)}


def test_key_hex_round_trips_and_rejects_junk() -> None:
    key = chunk_keys(FP, range(16), 16)[0]
    assert ObjectKey.from_hex(Kind.CHUNK, key.hex) == key
    for junk in ("../../etc/passwd", "ab" * 31, "zz" * 32):
        with pytest.raises(ValueError):
            ObjectKey.from_hex(Kind.CHUNK, junk)


def reference_checksum(payload: bytes) -> int:
    """The page-sum checksum written out plainly (the codec's vectorised one must agree)."""
    mask = (1 << 64) - 1
    total = 0
    for page_index, start in enumerate(range(0, len(payload), 4096)):
        page = payload[start:start + 4096]
        if len(page) == 4096:
            page_sum = sum(struct.unpack("<512Q", page)) & mask
        else:
            page_sum = zlib.crc32(page)
        z = (page_index * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        weight = (z ^ (z >> 31)) | 1
        total = (total + page_sum * weight) & mask
    return total


@pytest.mark.parametrize("size", [0, 1, 7, 8, 4095, 4096, 4097, 40000, 300_001])
def test_checksum_agrees_with_the_plain_reference(size: int) -> None:
    payload = random.Random(size).randbytes(size)
    assert Codec(FP).checksum(payload) == reference_checksum(payload)


def _envelope(codec: Codec, key: ObjectKey, payload: bytes) -> bytes:
    return codec.header(key, payload) + payload


def _open(codec: Codec, key: ObjectKey, blob: bytes) -> bytes:
    header = codec.check_header(key, blob[:HEADER_BYTES])
    payload = blob[HEADER_BYTES:]
    codec.check_payload(header, payload)
    return payload


def test_every_single_bit_flip_is_caught() -> None:
    codec = Codec(FP)
    key = chunk_keys(FP, range(16), 16)[0]
    payload = os.urandom(9000)
    blob = _envelope(codec, key, payload)
    assert _open(codec, key, blob) == payload
    rng = random.Random(0)
    positions = list(range(HEADER_BYTES)) + rng.sample(range(HEADER_BYTES, len(blob)), 300)
    for pos in positions:
        flipped = bytearray(blob)
        flipped[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(CorruptObject):
            _open(codec, key, bytes(flipped))


def test_torn_swapped_and_foreign_objects_are_caught() -> None:
    codec = Codec(FP)
    k1, k2 = chunk_keys(FP, range(32), 16)
    payload = os.urandom(3 * 4096)
    blob = _envelope(codec, k1, payload)
    pages = [payload[i:i + 4096] for i in range(0, len(payload), 4096)]
    torn = [
        blob[:-1],  # truncated
        blob[:HEADER_BYTES + 4096],
        blob[:HEADER_BYTES] + pages[1] + pages[0] + pages[2],  # pages swapped
        blob[:HEADER_BYTES] + bytes(4096) + payload[4096:],  # a page never written
    ]
    for bad in torn:
        with pytest.raises(CorruptObject):
            _open(codec, k1, bad)
    with pytest.raises(CorruptObject):
        _open(codec, k2, blob)  # stored under another key
    with pytest.raises(CorruptObject):
        _open(Codec(Fingerprint(hashlib.blake2b(b"x", digest_size=16).digest())), k1, blob)
    future = bytearray(blob)
    future[4:6] = (2).to_bytes(2, "little")  # a later format version (crc fixed up)
    future[76:80] = zlib.crc32(bytes(future[:76])).to_bytes(4, "little")
    with pytest.raises(CorruptObject, match="format version"):
        _open(codec, k1, bytes(future))
