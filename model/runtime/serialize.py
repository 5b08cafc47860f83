"""A sequence's cache as bytes: long-range chunks and a window-state object.

A conversation's long-range state (compressed entries and indexer keys of every KV
source) is cut by token position into chunks of ``chunk_tokens`` tokens; the chunk
length is a multiple of every pooling ratio and of the candidate block, so a chunk
holds whole entries and whole candidate blocks. Everything else — the windows of
every layer, the hidden states of incomplete pooling groups, the Engram n-gram
context, and the long-range rows past the last whole chunk — is one window-state
object (short-lived: host RAM only in V4.1).

Every object is ``header | payload``: a layout header, then raw rows in the cache
formats and little-endian integers (nothing is unpickled). The 32-byte header
(little-endian)::

     0  16  layout fingerprint (the layout version and every choice of the cache bytes)
    16   8  first token position
    24   8  tokens covered

It is not an envelope. Integrity and identity are the store's: every object that
rests in a storage tier is sealed by :mod:`storage.codec` (magic, format version,
kind, the model fingerprint, the object's key, a keyed MAC of the payload), which turns
a torn, foreign or misnamed object into a miss before it gets here. This layer
checks what only it knows: that the bytes are in this layout, at these positions,
and that the payload holds exactly its contents; any mismatch raises
:class:`StateError`, which callers treat as a cache miss. (A window state handed
from a prefill to a decoder replica crosses no tier: it is always a window state,
and the layout fingerprint still binds it to the layout.)
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..config import TextConfig
from ..formats import COMPRESSED_KV, INDEXER_KEY, WINDOW_KV
from .cache import PackedRows, SequenceCache

# Versions the byte layout; hashed into the layout fingerprint. 1 and 2 began with
# their own envelope (magic, version, kind; 1 also checksums and the model's identity).
LAYOUT_VERSION = 3
_HEADER = struct.Struct("<16sqq")
HEADER_BYTES = _HEADER.size  # 32


class StateError(ValueError):
    """Serialized state that is malformed, of another layout, or out of place."""


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(frozen=True)
class StateIdentity:
    """Who may share cache bytes: the model (config and weights: the store's
    fingerprint, in every key and envelope), the tokenizer, and the byte layout of the
    caches (in every serialized object's header)."""

    model: bytes
    tokenizer: bytes
    layout: bytes

    @classmethod
    def of(cls, config: TextConfig, weights_digest: bytes, tokenizer_fingerprint: str | bytes) -> "StateIdentity":
        canonical = json.dumps(config.to_dict(), sort_keys=True).encode()
        tokenizer = tokenizer_fingerprint.encode() if isinstance(tokenizer_fingerprint, str) else tokenizer_fingerprint
        return cls(model=_digest(canonical + weights_digest), tokenizer=_digest(tokenizer), layout=layout_fingerprint(config))


def layout_fingerprint(config: TextConfig) -> bytes:
    """A digest of every choice that decides the cache bytes: the layout version,
    formats, widths, sources."""
    sources = [(p.index, p.compress_ratio) for p in config.layer_plans() if p.is_kv_source]
    description = {
        "version": LAYOUT_VERSION,
        **{name: [f.element, f.block, f.scale] for name, f in (
            ("window", WINDOW_KV.for_width(config.head_dim)),
            ("entries", COMPRESSED_KV.for_width(config.head_dim)),
            ("keys", INDEXER_KEY.for_width(config.index_head_dim)))},
        "head_dim": config.head_dim,
        "index_head_dim": config.index_head_dim,
        "hidden_size": config.hidden_size,
        "layers": config.num_hidden_layers,
        "window_tokens": config.sliding_window,
        "sources": sources,
    }
    return _digest(json.dumps(description, sort_keys=True).encode())


def chunk_granularity(config: TextConfig) -> int:
    """The smallest valid chunk length: a multiple of every pooling ratio and of the
    candidate block (in tokens of the candidate source)."""
    plans = config.layer_plans()
    ratios = [p.compress_ratio for p in plans if p.is_kv_source]
    block = [config.candidate_block_size * p.compress_ratio for p in plans if p.is_candidate_source]
    return math.lcm(*ratios, *block) if ratios or block else 1


# ---------------------------------------------------------------------- layout header


def _with_header(identity: StateIdentity, start: int, tokens: int, payload: bytes) -> bytes:
    return _HEADER.pack(identity.layout, start, tokens) + payload


def _read_header(blob: bytes, identity: StateIdentity) -> tuple[int, int, memoryview]:
    """Check an object's layout header; returns (first position, tokens, payload). The
    payload's readers check that it holds exactly its contents."""
    if len(blob) < HEADER_BYTES:
        raise StateError("truncated header")
    view = memoryview(blob)
    layout, start, tokens = _HEADER.unpack_from(view)
    if layout != identity.layout:
        raise StateError("state of another cache layout")
    if start < 0 or tokens < 0:
        raise StateError("negative positions")
    return start, tokens, view[HEADER_BYTES:]


class _Reader:
    """Sequential reads from a verified payload; overruns are StateErrors."""

    def __init__(self, payload: memoryview):
        self.payload, self.offset = payload, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.offset + n > len(self.payload):
            raise StateError("payload shorter than its contents")
        part = self.payload[self.offset : self.offset + n]
        self.offset += n
        return part

    def ints(self, n: int) -> list[int]:
        return list(struct.unpack(f"<{n}q", self.take(8 * n)))

    def rows(self, n: int, width: int) -> torch.Tensor:
        data = bytes(self.take(n * width))
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(n, width) if n else torch.empty(0, width, dtype=torch.uint8)

    def floats(self, n: int, width: int) -> torch.Tensor:
        data = bytes(self.take(4 * n * width))
        return torch.frombuffer(bytearray(data), dtype=torch.float32).view(n, width) if n else torch.empty(0, width)

    def done(self) -> None:
        if self.offset != len(self.payload):
            raise StateError("payload longer than its contents")


def _sources(cache: SequenceCache) -> list[tuple[int, int]]:
    return [(p.index, p.compress_ratio) for p in cache.config.layer_plans() if p.is_kv_source]


# ---------------------------------------------------------------------- chunks


def chunk_to_bytes(cache: SequenceCache, start: int, tokens: int, identity: StateIdentity) -> bytes:
    """The long-range rows of positions ``[start, start + tokens)`` (whole chunk)."""
    granularity = chunk_granularity(cache.config)
    if start % granularity or tokens % granularity or start + tokens > cache.length:
        raise ValueError(f"chunk [{start}, {start + tokens}) is not whole or not cached")
    parts = []
    for source, ratio in _sources(cache):
        lo, hi = start // ratio, (start + tokens) // ratio
        for rows in (cache.entries[source], cache.keys[source]):
            if rows.n < hi:
                raise ValueError(f"layer {source} holds {rows.n} entries, the chunk needs {hi}")
            parts.append(rows.data[lo:hi].contiguous().numpy().tobytes())
    return _with_header(identity, start, tokens, b"".join(parts))


def load_chunk(cache: SequenceCache, blob: bytes, identity: StateIdentity) -> None:
    """Append a chunk to a cache whose long-range state ends exactly where it starts.

    Verifies everything before touching the cache: on error the cache is unchanged.
    """
    if load_chunks(cache, [blob], identity, strict=True) != 1:
        raise AssertionError("unreachable: a strict load raises instead")


def load_chunks(cache: SequenceCache, blobs: Iterable[bytes], identity: StateIdentity, strict: bool = False) -> int:
    """:func:`load_chunk` over consecutive chunks, up to the first that does not verify
    (it and those after it are left out; with ``strict`` its error is raised and
    nothing is loaded); returns how many were loaded.

    Each row store takes the rows of all the chunks in one byte join and one
    dequantisation: a returning turn's 256 chunks are 4 appends, not 1,024 (the
    per-chunk tensors cost more than the dequantisation). Values are those of
    loading the chunks one by one (the formats dequantise row by row)."""
    layout = _chunk_layout(cache)
    counts = [store.n for _, _, store in layout]
    staged: list[list[memoryview]] = [[] for _ in layout]
    length, loaded = cache.length, 0
    for blob in blobs:
        try:
            tokens, parts = _parse_chunk(layout, blob, identity, length, counts)
        except StateError:
            if strict:
                raise
            break
        for i, ((_, _, store), part) in enumerate(zip(layout, parts)):
            staged[i].append(part)
            counts[i] += len(part) // store.row_bytes
        length, loaded = length + tokens, loaded + 1
    for (_, _, store), parts in zip(layout, staged):
        data = b"".join(parts)
        if data:
            rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, store.row_bytes)
            store.append_bytes(rows.to(store.device))
    cache.length = length
    return loaded


def _chunk_layout(cache: SequenceCache) -> list[tuple[int, int, PackedRows]]:
    """(KV source, compress ratio, row store) for every row store a chunk covers, in
    its byte order: each source's entries, then its indexer keys."""
    return [(source, ratio, rows) for source, ratio in _sources(cache)
            for rows in (cache.entries[source], cache.keys[source])]


def _parse_chunk(layout, blob: bytes, identity: StateIdentity, length: int,
                 counts: list[int]) -> tuple[int, list[memoryview]]:
    """A chunk's token count and the bytes of its rows per row store (views into
    ``blob``), checked against a cache of ``length`` tokens whose stores hold
    ``counts`` rows; changes nothing."""
    start, tokens, payload = _read_header(blob, identity)
    if start != length:
        raise StateError(f"chunk starts at {start}, the cache ends at {length}")
    reader, parts = _Reader(payload), []
    for (source, ratio, store), count in zip(layout, counts):
        if count != start // ratio:
            raise StateError(f"layer {source}: cache holds {count} entries, chunk starts at {start // ratio}")
        parts.append(reader.take(((start + tokens) // ratio - start // ratio) * store.row_bytes))
    reader.done()
    return tokens, parts


# ---------------------------------------------------------------------- window state


def window_to_bytes(cache: SequenceCache, chunked: int, identity: StateIdentity) -> bytes:
    """Everything of ``cache`` not in its first ``chunked`` tokens' chunks: windows,
    pending pooling rows, the n-gram context, and long-range rows past ``chunked``."""
    parts = [struct.pack("<q", len(cache.windows))]
    for window in cache.windows:
        if window is None:
            parts.append(struct.pack("<qq", -1, 0))
        else:
            parts.append(struct.pack("<qq", window.start, window.rows.n))
            parts.append(window.rows.data.contiguous().numpy().tobytes())
    for source, ratio in _sources(cache):
        lo = chunked // ratio
        for rows in (cache.entries[source], cache.keys[source]):
            parts.append(struct.pack("<q", rows.n - lo))
            parts.append(rows.data[lo:].contiguous().numpy().tobytes())
        pending = cache.pending[source].float().contiguous()
        parts.append(struct.pack("<q", pending.shape[0]))
        parts.append(pending.cpu().numpy().tobytes())
    tail = [] if cache.ngram is None else cache.ngram.tail.flatten().tolist()
    parts.append(struct.pack(f"<q{len(tail)}q", len(tail), *tail))
    return _with_header(identity, chunked, cache.length - chunked, b"".join(parts))


def load_window(cache: SequenceCache, blob: bytes, identity: StateIdentity) -> None:
    """Restore a window-state object onto a cache holding exactly its chunks.

    Verifies and parses everything first: on error the cache is unchanged.
    """
    from ..engram import NgramContext
    from .cache import PackedRows, Window

    chunked, tokens, payload = _read_header(blob, identity)
    if chunked != cache.length:
        raise StateError(f"window state follows token {chunked}, the cache ends at {cache.length}")
    reader = _Reader(payload)
    (n_layers,) = reader.ints(1)
    if n_layers != len(cache.windows):
        raise StateError("window state of another layer count")
    windows = []
    for _ in range(n_layers):
        start, n = reader.ints(2)
        if start < 0:
            windows.append(None)
            continue
        rows = PackedRows(WINDOW_KV, cache.config.head_dim)
        windows.append((start, rows, reader.rows(n, rows.row_bytes)))
    staged, pending = [], {}
    for source, ratio in _sources(cache):
        for rows in (cache.entries[source], cache.keys[source]):
            if rows.n != chunked // ratio:
                raise StateError(f"layer {source}: cache holds {rows.n} entries, expected {chunked // ratio}")
            (n,) = reader.ints(1)
            staged.append((rows, reader.rows(n, rows.row_bytes)))
        (n,) = reader.ints(1)
        pending[source] = reader.floats(n, cache.config.hidden_size)
    (n_tail,) = reader.ints(1)
    tail = reader.ints(n_tail)
    reader.done()
    device = next(iter(cache.entries.values())).device if cache.entries else "cpu"
    for rows, data in staged:
        rows.append_bytes(data.to(device))
    for i, window in enumerate(windows):
        if window is None:
            cache.windows[i] = None
        else:
            start, rows, data = window
            rows.append_bytes(data)
            cache.windows[i] = Window(rows, start)
    cache.pending = {k: v.to(device) for k, v in pending.items()}
    if cache.ngram is not None and n_tail:
        cache.ngram = NgramContext(torch.tensor(tail, dtype=torch.long).view(cache.ngram.tail.shape))
    cache.length = chunked + tokens
