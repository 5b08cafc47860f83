"""The envelope every object carries on SSD and in Redis: format version, name, checksum.

Byte layout (little-endian), an 80-byte header followed by the payload:

    offset  size  field
         0     4  magic b"V41K"
         4     2  format version (1)
         6     1  kind (1 chunk, 2 window)
         7     1  flags (0)
         8    16  model fingerprint
        24    32  key digest (binds the bytes to their name: a swapped file is caught)
        56     8  payload length
        64     8  payload checksum (page-sum, below)
        72     4  reserved (0)
        76     4  crc32 of bytes 0..75
        80     n  payload

Payload checksum. CRC32 in this Python runs at ~2 GB/s, slower than reading a file
from the page cache (~6 GB/s for 256 KiB), so it would cost an SSD read more than
half its speed. The payload is instead cut into 4 KiB pages. A whole page's value is
the sum of its little-endian uint64 words mod 2**64 (one vectorised pass over all
pages); a last partial page's value is its CRC32 (cheaper than a numpy call for under
4 KiB). The checksum is sum(value[p] * w[p]) mod 2**64 with odd weights
w[p] = splitmix64(p) | 1. Every error confined to one page (any bit flips, a zeroed
or torn page) changes the checksum, because an odd weight is invertible mod 2**64;
swapped or truncated pages change it too (position weights, length in the header).
It is an integrity check against accidents, not a MAC: nothing read is ever
unpickled, so a forged object can only ever be wrong bytes under the writer's key.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

import numpy as np

from storage.keys import DIGEST_BYTES, Fingerprint, Kind, ObjectKey

MAGIC = b"V41K"
FORMAT_VERSION = 1
_FIELDS = struct.Struct("<4sHBB16s32sQQ4x")
_LEAD = struct.Struct("<4sHBB16s")  # magic, version, kind, flags, fingerprint: fixed per codec and kind
_TAIL = struct.Struct("<QQ4xI")  # payload length, checksum, reserved, header crc
_CRC = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _CRC.size  # 80
_PAGE_WORDS = 512  # 4 KiB pages of uint64 words
_PAGE_BYTES = 8 * _PAGE_WORDS
_MASK = (1 << 64) - 1


class CorruptObject(Exception):
    """Stored bytes that fail verification; the store counts it, removes it, reads a miss."""


class Header(NamedTuple):
    """The verified fields of an envelope header (a tuple: built on every read)."""

    payload_bytes: int
    checksum: int


def _splitmix64(index: np.ndarray) -> np.ndarray:
    # uint64 array arithmetic wraps mod 2**64, which is what splitmix64 wants.
    z = index * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Codec:
    """Builds and verifies envelopes for one model fingerprint. Thread-safe."""

    def __init__(self, fingerprint: Fingerprint) -> None:
        self.fingerprint = fingerprint
        self._weights = self._make_weights(64)
        self._first_weight = int(self._weights[0])
        self._lead = {kind: _LEAD.pack(MAGIC, FORMAT_VERSION, int(kind), 0, fingerprint.digest) for kind in Kind}

    @staticmethod
    def _make_weights(count: int) -> np.ndarray:
        return _splitmix64(np.arange(count, dtype=np.uint64)) | np.uint64(1)

    def _page_weights(self, count: int) -> np.ndarray:
        weights = self._weights
        if len(weights) < count:
            # Replacing the reference is atomic, so concurrent readers see old or new.
            weights = self._make_weights(max(count, 2 * len(weights)))
            self._weights = weights
        return weights[:count]

    def checksum(self, payload: bytes | memoryview) -> int:
        """The page-sum checksum of ``payload`` (see the module docstring)."""
        size = len(payload)
        pages = size // _PAGE_BYTES
        if not pages:  # the common small object: no numpy call at all
            return (zlib.crc32(payload) * self._first_weight) & _MASK if size else 0
        weights = self._page_weights(pages + 1)
        words = np.frombuffer(payload, dtype="<u8", count=pages * _PAGE_WORDS)
        page_sums = words.reshape(pages, _PAGE_WORDS).sum(axis=1)  # uint64, wraps mod 2**64
        total = int(page_sums.dot(weights[:pages]))  # integer dot: wraps mod 2**64 too
        if size > pages * _PAGE_BYTES:
            total += zlib.crc32(memoryview(payload)[pages * _PAGE_BYTES:]) * int(weights[pages])
        return total & _MASK

    def header(self, key: ObjectKey, payload: bytes | memoryview) -> bytes:
        """The 80-byte header for ``payload`` stored under ``key``."""
        fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, int(key.kind), 0, self.fingerprint.digest,
                              key.digest, len(payload), self.checksum(payload))
        return fields + _CRC.pack(zlib.crc32(fields))

    def check_header(self, key: ObjectKey, header: bytes) -> Header:
        """Verify a header read back for ``key``; raises CorruptObject on any mismatch."""
        # The hot path: compare the fixed fields as bytes, parse only the two numbers.
        if (len(header) == HEADER_BYTES and header.startswith(self._lead[key.kind])
                and header.startswith(key.digest, _LEAD.size)):
            size, checksum, crc = _TAIL.unpack_from(header, _LEAD.size + DIGEST_BYTES)
            if crc == zlib.crc32(header[:_FIELDS.size]):
                return Header(size, checksum)
        raise CorruptObject(self._diagnose(key, header))

    def _diagnose(self, key: ObjectKey, header: bytes) -> str:
        """Why a header failed (the slow path, for the error message only)."""
        if len(header) != HEADER_BYTES:
            return "short header"
        if _CRC.unpack_from(header, _FIELDS.size)[0] != zlib.crc32(header[:_FIELDS.size]):
            return "header checksum"
        magic, version, _kind, _flags, fingerprint, _digest, _size, _sum = _FIELDS.unpack_from(header)
        if magic != MAGIC:
            return "bad magic"
        if version != FORMAT_VERSION:
            return f"format version {version}"
        if _flags:
            return f"unknown flags {_flags:#x}"
        if fingerprint != self.fingerprint.digest:
            return "another model's object"
        return "object stored under another key"

    def check_payload(self, header: Header, payload: bytes | memoryview) -> None:
        """Verify ``payload`` against a checked header; raises CorruptObject."""
        if len(payload) != header.payload_bytes:
            raise CorruptObject("payload length")
        if self.checksum(payload) != header.checksum:
            raise CorruptObject("payload checksum")
