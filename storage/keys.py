"""Names of stored objects: hash chains over token ids, bound to a model fingerprint.

A conversation is cut into chunks of ``chunk_tokens`` tokens. Chunk i's key is

    blake2b-256(person="v41-chunk", fingerprint | parent key | media | token ids)

where the parent key is chunk i-1's key (32 zero bytes for the first chunk) and token
ids are little-endian int64. Two requests that share a prefix therefore share its chunk
keys, and two models (or two configs of one model) never share a key because the
fingerprint is hashed into every link. A window state (the tail of a conversation) is
named the same way over the last full chunk's key and the tail tokens, under its own
personalisation so that it can never collide with a chunk.

A :class:`KeyScope` puts a tenant's salt beside the fingerprint in each link (all of a
window state's; a chunk's unless it lies wholly within the scope's shared prefix), so
that two tenants' chains never meet, however alike their tokens.

Keys are digests, never user text: the SSD tier builds file names from ``ObjectKey.hex``
and nothing else.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

DIGEST_BYTES = 32
FINGERPRINT_BYTES = 16
_ROOT = bytes(DIGEST_BYTES)


class Kind(enum.IntEnum):
    """What an object holds, and so how long and where it is kept
    (:meth:`storage.policy.RetentionPolicy.retention_s`); the value is the byte written
    in the envelope. A conversation's cache is kept as its request asked
    (:class:`CacheRetention`): the deployment's retention, at most 24 hours, or in host
    RAM only for the window's minutes, each its own kind of chunk and window state."""

    CHUNK = 1  # long-range cache bytes of one chunk of tokens
    WINDOW = 2  # window state of a conversation's tail
    RESPONSE = 3  # a stored Responses API response and its input (JSON; cluster/serving/responses_api.py)
    CONVERSATION = 4  # a Conversations API conversation: its items and metadata (JSON)
    CHUNK_24H = 5  # a chunk whose request asked for 24 h at most
    WINDOW_24H = 6
    CHUNK_IN_MEMORY = 7  # a chunk whose request asked for host RAM only
    WINDOW_IN_MEMORY = 8


class CacheRetention(str, enum.Enum):
    """How long a request asks its conversation's cache to be kept (OpenAI's
    ``prompt_cache_retention``, and this project's 72 hours), shortest first."""

    IN_MEMORY = "in_memory"  # host RAM only, gone when the window's minutes end
    DAY = "24h"  # at most 24 hours after the last use, wherever kept
    DEFAULT = "72h"  # the deployment's retention (72 hours unless configured otherwise)

    @property
    def kinds(self) -> tuple[Kind, Kind]:
        """The kinds of the chunks and window states kept so."""
        return _KINDS[self]

    def at_most(self, other: "CacheRetention") -> "CacheRetention":
        """The shorter of the two."""
        return min(self, other, key=_ORDER.index)


_ORDER = list(CacheRetention)
_KINDS = {CacheRetention.DEFAULT: (Kind.CHUNK, Kind.WINDOW), CacheRetention.DAY: (Kind.CHUNK_24H, Kind.WINDOW_24H),
          CacheRetention.IN_MEMORY: (Kind.CHUNK_IN_MEMORY, Kind.WINDOW_IN_MEMORY)}


@dataclass(frozen=True)
class Fingerprint:
    """Identifies a model and the config its cache bytes depend on (16 bytes)."""

    digest: bytes

    def __post_init__(self) -> None:
        if len(self.digest) != FINGERPRINT_BYTES:
            raise ValueError(f"a fingerprint is {FINGERPRINT_BYTES} bytes, got {len(self.digest)}")

    @classmethod
    def of(cls, name: str, config: Mapping[str, object]) -> Fingerprint:
        """Fingerprint of a model name and its config (canonical JSON, key order ignored)."""
        text = json.dumps({"name": name, "config": config}, sort_keys=True, separators=(",", ":"))
        return cls(hashlib.blake2b(text.encode(), digest_size=FINGERPRINT_BYTES).digest())

    @property
    def hex(self) -> str:
        return self.digest.hex()


@dataclass(frozen=True, slots=True)
class ObjectKey:
    """The name of one stored object: its kind and a 32-byte digest. (Slotted: the
    retention lab keeps one per stored extent, tens of millions.)"""

    kind: Kind
    digest: bytes

    def __post_init__(self) -> None:
        if len(self.digest) != DIGEST_BYTES:
            raise ValueError(f"a key digest is {DIGEST_BYTES} bytes, got {len(self.digest)}")

    def __hash__(self) -> int:
        # The digest alone identifies the object (kinds hash under different
        # personalisations); hashing the enum too would cost more on every look-up.
        return hash(self.digest)

    @property
    def hex(self) -> str:
        """64 lowercase hex characters: safe as a file name and a Redis key part."""
        return self.digest.hex()

    @classmethod
    def from_hex(cls, kind: Kind, text: str) -> ObjectKey:
        """Parse ``hex``; raises ValueError for anything that is not 64 hex digits."""
        if len(text) != 2 * DIGEST_BYTES:
            raise ValueError("not a key digest")
        return cls(kind, bytes.fromhex(text))


@dataclass(frozen=True)
class KeyScope:
    """Whose chain a key belongs to, and how long it is kept: ``salt`` (a tenant's
    secret, 16 bytes; empty: the deployment's own namespace, as a server with one tenant
    names everything) is hashed into every link, except the chunks that end within the
    first ``shared_tokens`` tokens (a prefix the deployment shares between tenants on
    purpose); ``retention`` gives the keys their kinds (the digests do not depend on it:
    a chunk kept another way replaces the object of the same digest)."""

    salt: bytes = b""
    shared_tokens: int = 0
    retention: CacheRetention = CacheRetention.DEFAULT

    def namespace(self, fingerprint: Fingerprint, end: int | None = None) -> bytes:
        """What a link hashes before its parent: the fingerprint, and the salt unless
        the link's tokens end (``end``; None: a window state) within the shared prefix."""
        if not self.salt or (end is not None and end <= self.shared_tokens):
            return fingerprint.digest
        return fingerprint.digest + self.salt


NO_SCOPE = KeyScope()


@dataclass(frozen=True)
class MediaSpan:
    """Content that token ids do not capture (an image), placed at a token position.

    An image is a run of placeholder ids, so its pixels must enter the key: the chunk
    holding ``position`` hashes ``digest`` (e.g. a hash of the image bytes) into its link.
    """

    position: int
    digest: bytes


def _as_ids(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    ids = np.asarray(token_ids, dtype="<i8")
    if ids.ndim != 1:
        raise ValueError("token ids must be one-dimensional")
    return ids


def _link(person: bytes, namespace: bytes, parent: bytes, ids: np.ndarray,
          media: Sequence[MediaSpan], start: int) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=person)
    h.update(namespace)
    h.update(parent)
    h.update(len(ids).to_bytes(8, "little"))
    for span in media:
        if start <= span.position < start + len(ids):
            h.update((span.position - start).to_bytes(8, "little"))
            h.update(len(span.digest).to_bytes(8, "little"))
            h.update(span.digest)
    h.update(ids.tobytes())
    return h.digest()


def chunk_keys(fingerprint: Fingerprint, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int,
               media: Sequence[MediaSpan] = (), known: Sequence[ObjectKey] = (),
               scope: KeyScope = NO_SCOPE) -> list[ObjectKey]:
    """Keys of every full chunk of ``token_ids``, in order; a partial tail has no key.

    ``known``: the keys of the first chunks, already computed for the same tokens (a
    request's plan, in the same ``scope``); the chain is hashed on from the last of them.
    """
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    ids = _as_ids(token_ids)
    chunk_kind = scope.retention.kinds[0]
    known = list(known[: len(ids) // chunk_tokens])
    keys: list[ObjectKey] = known
    parent = known[-1].digest if known else _ROOT
    for start in range(len(known) * chunk_tokens, len(ids) - chunk_tokens + 1, chunk_tokens):
        parent = _link(b"v41-chunk", scope.namespace(fingerprint, start + chunk_tokens), parent,
                       ids[start:start + chunk_tokens], media, start)
        keys.append(ObjectKey(chunk_kind, parent))
    return keys


def window_key(fingerprint: Fingerprint, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int,
               media: Sequence[MediaSpan] = (), known: Sequence[ObjectKey] = (),
               scope: KeyScope = NO_SCOPE) -> ObjectKey:
    """Key of the window state after all of ``token_ids`` (a state depends on the whole
    prefix); ``known`` and ``scope`` as for :func:`chunk_keys`."""
    ids = _as_ids(token_ids)
    chunks = chunk_keys(fingerprint, ids, chunk_tokens, media, known, scope)
    parent = chunks[-1].digest if chunks else _ROOT
    start = len(chunks) * chunk_tokens
    link = _link(b"v41-window", scope.namespace(fingerprint), parent, ids[start:], media, start)
    return ObjectKey(scope.retention.kinds[1], link)


def window_keys_after(fingerprint: Fingerprint, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int,
                      chunked: int, media: Sequence[MediaSpan] = (), known: Sequence[ObjectKey] = (),
                      scope: KeyScope = NO_SCOPE) -> list[tuple[int, ObjectKey]]:
    """``(n, window_key(token_ids[:n]))`` for every ``n`` from ``chunked`` (a chunk
    boundary) up to the next boundary or the end, longest first: the window states a
    prompt could resume from after its first ``chunked`` tokens, with the chunk chain
    hashed once (or not at all: ``known`` and ``scope`` as for :func:`chunk_keys`)."""
    if chunked % chunk_tokens:
        raise ValueError("chunked must be a multiple of chunk_tokens")
    ids = _as_ids(token_ids)
    chunks = chunk_keys(fingerprint, ids[:chunked], chunk_tokens, media, known, scope)
    parent = chunks[-1].digest if chunks else _ROOT
    last = min(len(ids), chunked + chunk_tokens - 1)
    namespace, kind = scope.namespace(fingerprint), scope.retention.kinds[1]
    return [(n, ObjectKey(kind, _link(b"v41-window", namespace, parent, ids[chunked:n], media, chunked)))
            for n in range(last, chunked - 1, -1)]


def _owned(owner: str, record_id: str) -> bytes:
    """A record's id under its owner (a tenant; "": a server with one): another owner's
    name of the same id is another key."""
    return record_id.encode() if not owner else b"%d:%s\0%s" % (len(owner), owner.encode(), record_id.encode())


def response_key(response_id: str, owner: str = "") -> ObjectKey:
    """Key of a stored response (``POST /v1/responses`` with ``store``), by its id and owner."""
    digest = hashlib.blake2b(_owned(owner, response_id), digest_size=DIGEST_BYTES, person=b"v41-response").digest()
    return ObjectKey(Kind.RESPONSE, digest)


def conversation_key(conversation_id: str, owner: str = "") -> ObjectKey:
    """Key of a conversation (``POST /v1/conversations``), by its id and owner."""
    digest = hashlib.blake2b(_owned(owner, conversation_id), digest_size=DIGEST_BYTES,
                             person=b"v41-conversation").digest()
    return ObjectKey(Kind.CONVERSATION, digest)
