"""The envelope every object carries on SSD and in Redis: format version, name, checksum.

Byte layout (little-endian), an 80-byte header followed by the payload:

    offset  size  field
         0     4  magic b"V41K"
         4     2  format version (2)
         6     1  kind (1 chunk, 2 window, 3 response, 4 conversation)
         7     1  flags (0)
         8    16  model fingerprint
        24    32  key digest (binds the bytes to their name: a swapped file is caught)
        56     8  payload length
        64     8  payload checksum (XXH3-64, below)
        72     4  reserved (0)
        76     4  crc32 of bytes 0..75
        80     n  payload

Payload checksum: XXH3-64 (seed 0) of the payload, from the ``xxhash`` package. A
changed payload (flipped bits, swapped or shifted words, a zeroed or torn page,
changes that cancel in a sum) keeps its checksum with probability about 2**-64: XXH3
is a well-mixed 64-bit hash, so no error pattern is special to it. (Unlike a CRC it
guarantees nothing for specific patterns such as short bursts; at 64 bits the odds
are what matter.) Truncation is caught by the length as well. It runs at ~20-30 GB/s
here, faster than reading the bytes from the page cache, whereas CRC32 in this
Python (~1.5-2.5 GB/s) would cost an SSD read most of its speed.

Format version 1 summed uint64 words per 4 KiB page, which changes that cancel
inside a page (two words swapped, +2**k in one and -2**k in another) did not change;
its objects fail the version check and read as misses.

It is an integrity check against accidents, not a MAC: nothing read is ever
unpickled, so a forged object can only ever be wrong bytes under the writer's key.
"""

from __future__ import annotations

import struct
import zlib
import xxhash

from storage.keys import DIGEST_BYTES, Fingerprint, Kind, ObjectKey

MAGIC = b"V41K"
FORMAT_VERSION = 2
_FIELDS = struct.Struct("<4sHBB16s32sQQ4x")
_LEAD = struct.Struct("<4sHBB16s")  # magic, version, kind, flags, fingerprint: fixed per codec and kind
_TAIL = struct.Struct("<QQ4xI")  # payload length, checksum, reserved, header crc
_CRC = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _CRC.size  # 80
_TAIL_AT = _LEAD.size + DIGEST_BYTES  # 56


def checksum(payload: bytes | bytearray | memoryview) -> int:
    """The payload checksum: XXH3-64 with seed 0 (no copy of ``payload``)."""
    return xxhash.xxh3_64_intdigest(payload)


class CorruptObject(Exception):
    """Stored bytes that fail verification; the store counts it, removes it, reads a miss."""


# The verified numbers of a header: (payload length, payload checksum). A plain tuple,
# built on every read: a NamedTuple costs more to build than the rest of the check.
Header = tuple[int, int]


class Codec:
    """Builds and verifies envelopes for one model fingerprint. Thread-safe (immutable)."""

    def __init__(self, fingerprint: Fingerprint) -> None:
        self.fingerprint = fingerprint
        self._lead = {kind: _LEAD.pack(MAGIC, FORMAT_VERSION, int(kind), 0, fingerprint.digest) for kind in Kind}

    def header(self, key: ObjectKey, payload: bytes | memoryview) -> bytes:
        """The 80-byte header for ``payload`` stored under ``key``."""
        fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, int(key.kind), 0, self.fingerprint.digest,
                              key.digest, len(payload), checksum(payload))
        return fields + _CRC.pack(zlib.crc32(fields))

    def check_header(self, key: ObjectKey, data: bytes, start: int = 0) -> Header:
        """Verify the header at ``data[start:start + 80]`` for ``key`` (``data`` may run on
        past it; only the 76 bytes under the CRC are copied); raises CorruptObject."""
        # The hot path: compare the fixed fields in place, parse only the two numbers.
        if (len(data) >= start + HEADER_BYTES and data.startswith(self._lead[key.kind], start)
                and data.startswith(key.digest, start + _LEAD.size)):
            size, payload_sum, crc = _TAIL.unpack_from(data, start + _TAIL_AT)
            if crc == zlib.crc32(data[start:start + _FIELDS.size]):
                return size, payload_sum
        raise CorruptObject(self._diagnose(key, bytes(data[start:start + HEADER_BYTES])))

    def _diagnose(self, key: ObjectKey, header: bytes) -> str:
        """Why a header failed (the slow path, for the error message only)."""
        if len(header) != HEADER_BYTES:
            return "short header"
        if _CRC.unpack_from(header, _FIELDS.size)[0] != zlib.crc32(header[:_FIELDS.size]):
            return "header checksum"
        magic, version, kind, flags, fingerprint, _digest, _size, _sum = _FIELDS.unpack_from(header)
        if magic != MAGIC:
            return "bad magic"
        if version != FORMAT_VERSION:
            return f"format version {version}"
        if flags:
            return f"unknown flags {flags:#x}"
        if fingerprint != self.fingerprint.digest:
            return "another model's object"
        if kind != key.kind:
            return f"an object of kind {kind}"
        return "object stored under another key"

    @staticmethod
    def check_payload(header: Header, payload: bytes | memoryview) -> None:
        """Verify ``payload`` against a checked header; raises CorruptObject."""
        size, payload_sum = header
        if len(payload) != size:
            raise CorruptObject("payload length")
        if checksum(payload) != payload_sum:
            raise CorruptObject("payload checksum")

    def check(self, key: ObjectKey, data: bytes, start: int = 0) -> memoryview:
        """Verify the envelope that fills ``data[start:]`` (header, then exactly its payload)
        and return the payload as a view into ``data``; raises CorruptObject."""
        header = self.check_header(key, data, start)
        payload = memoryview(data)[start + HEADER_BYTES:]
        self.check_payload(header, payload)
        return payload
