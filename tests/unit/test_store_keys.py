"""Keys and envelopes of the tiered store: hash chains, fingerprints, MACs, verification."""

from __future__ import annotations

import hashlib
import os
import random
import zlib

import blake3
import numpy as np
import xxhash
import pytest

from storage.codec import FORMAT_VERSION, HEADER_BYTES, Codec, CorruptObject
from storage.keys import Fingerprint, Kind, MediaSpan, ObjectKey, chunk_keys, window_key, window_keys_after

pytestmark = pytest.mark.unit

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


@pytest.mark.parametrize("size", [0, 1, 7, 8, 240, 4095, 4096, 4097, 40000, 300_001])
def test_the_mac_is_keyed_blake3_of_the_header_fields_and_payload(size: int) -> None:
    """As storage/codec.py lays it out, computed here with the blake3 and xxhash packages
    alone: the MAC is the first 8 bytes (little-endian) of BLAKE3 keyed by the secret's
    derived key, over the payload and then the header's bytes 0..63 (magic, version,
    kind, flags, fingerprint, key digest, length); the checksum is the payload's XXH3-64."""
    payload = random.Random(size).randbytes(size)
    secret = b"the cluster's secret, 32 bytes!!"
    key = chunk_keys(FP, range(16), 16)[0]
    blob = Codec(FP, secret).header(key, payload)
    derived = blake3.blake3(secret, derive_key_context="v41 2026-12-06 store object MAC").digest()
    fields = b"V41K" + FORMAT_VERSION.to_bytes(2, "little") + bytes([int(Kind.CHUNK), 0]) + FP.digest + key.digest
    fields += size.to_bytes(8, "little")
    assert blob[:64] == fields
    assert blob[64:72] == blake3.blake3(payload + fields, key=derived).digest(8)
    assert blob[72:80] == xxhash.xxh3_64(payload).intdigest().to_bytes(8, "little")
    assert blob[80:84] == bytes(4) and blob[84:88] == zlib.crc32(blob[:84]).to_bytes(4, "little")
    unkeyed = Codec(FP).header(key, payload)  # no secret: keyed by the (public) fingerprint
    assert unkeyed[64:72] == blake3.blake3(payload + fields, key=blake3.blake3(
        FP.digest, derive_key_context="v41 2026-12-06 store object MAC").digest()).digest(8) != blob[64:72]


def test_an_object_planted_without_the_secret_fails_its_mac() -> None:
    """Whoever can write Redis or a cache file but lacks the cluster's secret can form a
    perfect envelope (header CRC, length, name, checksum) and still not the MAC. The
    checksum alone does not tell (which is why only a private folder's reads rely on it)."""
    key = chunk_keys(FP, range(16), 16)[0]
    payload = os.urandom(5000)
    store_codec = Codec(FP, b"s" * 32)
    assert _open(store_codec, key, _envelope(store_codec, key, payload)) == payload
    for forger in (Codec(FP), Codec(FP, b"t" * 32)):
        planted = _envelope(forger, key, payload)
        store_codec.check_header(key, planted[:HEADER_BYTES])  # well formed
        assert _open(store_codec, key, planted, mac=False) == payload
        with pytest.raises(CorruptObject, match="payload MAC"):
            _open(store_codec, key, planted)


def _envelope(codec: Codec, key: ObjectKey, payload: bytes) -> bytes:
    return codec.header(key, payload) + payload


def _open(codec: Codec, key: ObjectKey, blob: bytes, mac: bool = True) -> bytes:
    header = codec.check_header(key, blob[:HEADER_BYTES])
    payload = blob[HEADER_BYTES:]
    codec.check_payload(key, header, payload, mac)
    assert codec.check(key, blob, 0, mac) == payload  # the one-buffer path agrees
    return payload


@pytest.mark.parametrize("mac", [True, False], ids=["mac", "checksum"])
def test_every_single_bit_flip_is_caught(mac: bool) -> None:
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
            _open(codec, key, bytes(flipped), mac)


@pytest.mark.parametrize("mac", [True, False], ids=["mac", "checksum"])
def test_torn_swapped_and_foreign_objects_are_caught(mac: bool) -> None:
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
            _open(codec, k1, bad, mac)
    with pytest.raises(CorruptObject):
        _open(codec, k2, blob, mac)  # stored under another key
    with pytest.raises(CorruptObject):
        _open(Codec(Fingerprint(hashlib.blake2b(b"x", digest_size=16).digest())), k1, blob, mac)
    # page sums, XXH3 alone, fields-first MAC, MAC alone, a later one (crc fixed up)
    for version in (1, 2, 3, 4, FORMAT_VERSION + 1):
        other = bytearray(blob)
        other[4:6] = version.to_bytes(2, "little")
        other[84:88] = zlib.crc32(bytes(other[:84])).to_bytes(4, "little")
        with pytest.raises(CorruptObject, match=f"format version {version}"):
            _open(codec, k1, bytes(other), mac)


def _page_word_sums(payload: bytes) -> list[int]:
    """Per-4-KiB-page sums of uint64 words mod 2**64: what format 1's checksum was built from."""
    words = np.frombuffer(payload, dtype="<u8").reshape(-1, 512)
    return [int(page) for page in words.sum(axis=1)]


@pytest.mark.parametrize("mac", [True, False], ids=["mac", "checksum"])
def test_changes_that_cancel_inside_a_page_are_caught(mac: bool) -> None:
    codec = Codec(FP)
    key = chunk_keys(FP, range(16), 16)[0]
    payload = os.urandom(3 * 4096)
    blob = _envelope(codec, key, payload)
    words = np.frombuffer(payload, dtype="<u8")
    swapped = words.copy()
    swapped[[520, 530]] = swapped[[530, 520]]  # two words of page 1 trade places
    shifted = words.copy()
    shifted[600] += np.uint64(1 << 40)  # +2**40 in one word of page 1, -2**40 in another
    shifted[700] -= np.uint64(1 << 40)
    for bad_words in (swapped, shifted):
        bad = bad_words.tobytes()
        assert bad != payload and _page_word_sums(bad) == _page_word_sums(payload)  # format 1 missed these
        with pytest.raises(CorruptObject, match="payload MAC" if mac else "payload checksum"):
            _open(codec, key, blob[:HEADER_BYTES] + bad, mac)


def test_window_keys_after_equal_window_key_of_each_prefix():
    from storage.keys import Fingerprint, window_key, window_keys_after

    fp = Fingerprint.of("m", {"a": 1})
    ids = list(range(100, 300))
    for chunked in (0, 64, 192):
        listed = window_keys_after(fp, ids, 64, chunked)
        assert [n for n, _ in listed] == list(range(min(len(ids), chunked + 63), chunked - 1, -1))
        assert all(key == window_key(fp, ids[:n], 64) for n, key in listed)


def test_known_chunk_keys_continue_the_chain():
    fp = Fingerprint.of("m", {"a": 1})
    ids = list(range(1000, 1000 + 7 * 16 + 5))
    full = chunk_keys(fp, ids, 16)
    assert chunk_keys(fp, ids, 16, known=full[:3]) == full
    assert chunk_keys(fp, ids[: 4 * 16], 16, known=full) == full[:4]  # known keys past the tokens are ignored
    assert window_key(fp, ids, 16, known=full[:5]) == window_key(fp, ids, 16)
    assert window_keys_after(fp, ids, 16, 48, known=full[:3]) == window_keys_after(fp, ids, 16, 48)


def test_a_scope_salts_every_name_but_a_shared_prefixs_chunks():
    """Two tenants' chains never meet, however alike their tokens; chunks wholly within
    the shared prefix are named as a server with one tenant names them (no salt), the
    chain goes on from them under each tenant's salt; window states are always salted;
    stored records are named under their owner."""
    from storage.keys import KeyScope, conversation_key, response_key

    fp = Fingerprint.of("m", {"a": 1})
    ids = list(range(500, 500 + 6 * 16 + 3))
    plain = chunk_keys(fp, ids, 16)
    a, b = KeyScope(b"a" * 16), KeyScope(b"b" * 16)
    ka, kb = chunk_keys(fp, ids, 16, scope=a), chunk_keys(fp, ids, 16, scope=b)
    assert chunk_keys(fp, ids, 16, scope=KeyScope()) == plain
    assert not set(ka) & set(kb) and not set(ka) & set(plain)
    shared_a, shared_b = KeyScope(b"a" * 16, 40), KeyScope(b"b" * 16, 40)
    sa, sb = chunk_keys(fp, ids, 16, scope=shared_a), chunk_keys(fp, ids, 16, scope=shared_b)
    assert sa[:2] == sb[:2] == plain[:2]  # tokens 0..31 lie within the shared 40; chunk 2 (32..47) does not
    assert sa[2] != sb[2] and sa[2] != plain[2] and not set(sa[2:]) & set(sb[2:])
    assert window_key(fp, ids[:20], 16, scope=shared_a) != window_key(fp, ids[:20], 16, scope=shared_b)
    assert window_key(fp, ids, 16, known=sa[:3], scope=shared_a) == window_key(fp, ids, 16, scope=shared_a)
    assert window_keys_after(fp, ids, 16, 48, scope=a) == [(n, window_key(fp, ids[:n], 16, scope=a))
                                                           for n, _ in window_keys_after(fp, ids, 16, 48)]
    assert response_key("resp_1") == response_key("resp_1", "") != response_key("resp_1", "acme")
    assert response_key("resp_1", "acme") != response_key("resp_1", "other")
    assert conversation_key("conv_1", "a") != conversation_key("conv_1", "b") != conversation_key("conv_1")
    # The owner's name is length-prefixed: no two (owner, id) pairs run together.
    assert response_key("1:b", "a") != response_key("b", "a:1")
