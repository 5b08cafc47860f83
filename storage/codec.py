"""The envelope every object carries on SSD and in Redis: format version, name, MAC, checksum.

Byte layout (little-endian), an 88-byte header followed by the payload:

    offset  size  field
         0     4  magic b"V41K"
         4     2  format version (5)
         6     1  kind (storage.keys.Kind: 1 chunk, 2 window, 3 response, 4 conversation,
                  5-8 chunks and window states kept 24 h or in RAM only)
         7     1  flags (0)
         8    16  model fingerprint
        24    32  key digest (binds the bytes to their name: a swapped file is caught)
        56     8  payload length
        64     8  MAC (below)
        72     8  XXH3-64 of the payload (below)
        80     4  reserved (0)
        84     4  crc32 of bytes 0..83
        88     n  payload

MAC: the first 8 bytes of keyed BLAKE3 (the ``blake3`` package) over the payload
followed by bytes 0..63 of the header (the object's kind, model, name and length). The
payload comes first so that it starts at BLAKE3's chunk 0: after a 64-byte prefix the
hash can only take the payload's chunks in small aligned groups, and a 16 KiB MAC cost
~8.6 us instead of ~4.9 (format 3 hashed the fields first). The fields are the last 64
bytes hashed and hold the payload's length, so the split of the input is never
ambiguous. Its key is derived from the cluster's secret (the app's
``cache_secret_file``, which every node's store reads): an object planted by whoever
can write Redis or a cache file, but does not hold the secret, fails it, reads as a
miss and is counted as corrupt, however well its bytes are formed. A store opened
without a secret keys the MAC with the model's fingerprint, which is public: it then
guards against accidents only. Against accidents either way: a changed payload
(flipped bits, swapped or shifted words, a zeroed or torn page, changes that cancel in
a sum) passes with probability 2**-64.

Checksum: XXH3-64 of the payload, against accidents only. A reader that knows no one
without the secret can have written the bytes checks it instead of the MAC: the SSD
tier in a private folder tree (``storage.private.why_not_private``), where only the
store's own user, who can read the secret, or root can write. On one core of the
2-core AMD EPYC VM keyed BLAKE3 runs at ~3.3-4 GB/s (16 KiB in ~4.9 us, 256 KiB in
~63 us, two thirds of a raw 256 KiB read) and XXH3-64 at ~30 GB/s (16 KiB in ~0.6 us,
256 KiB in ~7 us); keyed BLAKE2b (~0.8 GB/s) would cost a 16 KiB read ~19 us.

Format versions 1 (sums of uint64 words per 4 KiB page), 2 (an unkeyed XXH3-64 alone),
3 (the MAC with the header's fields hashed first) and 4 (the MAC alone) fail the
version check and read as misses.
"""

from __future__ import annotations

import struct
import zlib

import blake3
import xxhash

from storage.keys import DIGEST_BYTES, Fingerprint, Kind, ObjectKey

MAGIC = b"V41K"
FORMAT_VERSION = 5
_MAC_CONTEXT = "v41 2026-12-06 store object MAC"  # BLAKE3's key derivation context: this use alone
_FIELDS = struct.Struct("<4sHBB16s32sQQQ4x")
_LEAD = struct.Struct("<4sHBB16s")  # magic, version, kind, flags, fingerprint: fixed per codec and kind
_TAIL = struct.Struct("<QQQ4xI")  # payload length, MAC, checksum, reserved, header crc
_CRC = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _CRC.size  # 88
_TAIL_AT = _LEAD.size + DIGEST_BYTES  # 56
_SIZE = struct.Struct("<Q")


def mac_key(secret: bytes) -> bytes:
    """The 32-byte MAC key derived from a secret (BLAKE3's key derivation)."""
    return blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()


class CorruptObject(Exception):
    """Stored bytes that fail verification; the store counts it, removes it, reads a miss."""


# The verified numbers of a header: (payload length, payload MAC, payload checksum). A
# plain tuple, built on every read: a NamedTuple costs more to build than the rest of the check.
Header = tuple[int, int, int]


class Codec:
    """Builds and verifies envelopes for one model fingerprint, their MACs keyed by
    ``secret`` (None: by the fingerprint, a checksum). Thread-safe (immutable)."""

    def __init__(self, fingerprint: Fingerprint, secret: bytes | None = None) -> None:
        self.fingerprint = fingerprint
        self._lead = {kind: _LEAD.pack(MAGIC, FORMAT_VERSION, int(kind), 0, fingerprint.digest) for kind in Kind}
        self._key = mac_key(fingerprint.digest if secret is None else secret)

    def mac(self, key: ObjectKey, payload: bytes | bytearray | memoryview) -> int:
        """The MAC of ``payload`` stored under ``key`` (no copy of ``payload``)."""
        state = blake3.blake3(payload, key=self._key)
        state.update(self._lead[key.kind] + key.digest + _SIZE.pack(len(payload)))
        return int.from_bytes(state.digest(8), "little")

    def header(self, key: ObjectKey, payload: bytes | memoryview) -> bytes:
        """The 88-byte header for ``payload`` stored under ``key``."""
        fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, int(key.kind), 0, self.fingerprint.digest, key.digest,
                              len(payload), self.mac(key, payload), xxhash.xxh3_64_intdigest(payload))
        return fields + _CRC.pack(zlib.crc32(fields))

    def check_header(self, key: ObjectKey, data: bytes, start: int = 0) -> Header:
        """Verify the header at ``data[start:start + 88]`` for ``key`` (``data`` may run on
        past it; only the 84 bytes under the CRC are copied); raises CorruptObject."""
        # The hot path: compare the fixed fields in place, parse only the three numbers.
        if (len(data) >= start + HEADER_BYTES and data.startswith(self._lead[key.kind], start)
                and data.startswith(key.digest, start + _LEAD.size)):
            size, tag, checksum, crc = _TAIL.unpack_from(data, start + _TAIL_AT)
            if crc == zlib.crc32(data[start:start + _FIELDS.size]):
                return size, tag, checksum
        raise CorruptObject(self._diagnose(key, bytes(data[start:start + HEADER_BYTES])))

    def _diagnose(self, key: ObjectKey, header: bytes) -> str:
        """Why a header failed (the slow path, for the error message only)."""
        if len(header) != HEADER_BYTES:
            return "short header"
        if _CRC.unpack_from(header, _FIELDS.size)[0] != zlib.crc32(header[:_FIELDS.size]):
            return "header checksum"
        magic, version, kind, flags, fingerprint, _digest, _size, _tag, _checksum = _FIELDS.unpack_from(header)
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

    def check_payload(self, key: ObjectKey, header: Header, payload: bytes | memoryview,
                      mac: bool = True) -> None:
        """Verify ``payload`` against the checked header of ``key``'s object: its MAC, or
        with ``mac=False`` its checksum only (bytes that only holders of the secret can
        have written); raises CorruptObject."""
        size, tag, checksum = header
        if len(payload) != size:
            raise CorruptObject("payload length")
        if mac:
            if self.mac(key, payload) != tag:
                raise CorruptObject("payload MAC")
        elif xxhash.xxh3_64_intdigest(payload) != checksum:
            raise CorruptObject("payload checksum")

    def check(self, key: ObjectKey, data: bytes, start: int = 0, mac: bool = True) -> memoryview:
        """Verify the envelope that fills ``data[start:]`` (header, then exactly its payload;
        ``mac`` as for ``check_payload``) and return the payload as a view into ``data``;
        raises CorruptObject."""
        header = self.check_header(key, data, start)
        payload = memoryview(data)[start + HEADER_BYTES:]
        self.check_payload(key, header, payload, mac)
        return payload
