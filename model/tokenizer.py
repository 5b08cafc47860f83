"""The V4.1 vocabulary: a byte-level BPE tokenizer with the chat format's special tokens.

``Tokenizer`` wraps a Hugging Face ``tokenizers`` byte-level BPE: plain-text
encode/decode, the special token ids by role (:class:`SpecialTokens`), a fingerprint
for cache keys, ``IncrementalDetokenizer`` for streaming, and ``EncodeMemo``, which
remembers the ids of long texts a conversation sends again every turn. Special ids
enter prompts only through :class:`model.chat.ChatTemplate`, which renders
conversations with it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import tokenizers

from model.tools import DSML


class ChatFormatError(ValueError):
    """A conversation, chat option or vocabulary that the V4.1 chat format cannot express."""


BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SYSTEM_TOKEN = "<｜System｜>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
IMAGE_TOKEN = "<｜deepseek_image｜>"

_GIL_FREE_CHARS = 4096  # (shorter texts: ``encode`` is a little faster)


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the tokens the chat format and the engine refer to by role.

    ``system`` is None when the vocabulary has no ``<｜System｜>`` token;
    ``noise`` (the DSpark drafter's filler token) is None unless the checkpoint
    config names one.
    """

    bos: int
    eos: int
    pad: int
    user: int
    assistant: int
    think_start: int
    think_end: int
    image: int
    system: int | None = None
    noise: int | None = None
    dsml: int | None = None  # ｜DSML｜, the tool-call markup's token (None: spelled as text)


class Tokenizer:
    """A byte-level BPE tokenizer with DeepSeek's special tokens.

    ``encode`` treats its input as plain text: the spelling of a special token
    inside user text is encoded as ordinary bytes, so a user cannot inject turn
    markers. Special ids enter prompts only through ``ChatTemplate``.
    """

    def __init__(self, tokenizer_json: str, config: dict | None = None, noise_token_id: int | None = None):
        """Build from the text of ``tokenizer.json`` and the parsed ``tokenizer_config.json``.

        Raises ``ChatFormatError`` when a required special token is missing.
        """
        config = config or {}
        self._plain = tokenizers.Tokenizer.from_str(tokenizer_json)
        # A second instance for decoding keeps encode_special_tokens immutable per
        # instance: flipping it on a shared object would race between threads.
        self._plain.encode_special_tokens = True
        self._decoder = tokenizers.Tokenizer.from_str(tokenizer_json)
        self.fingerprint = hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()[:16]
        self._added = frozenset(self._decoder.get_added_tokens_decoder())
        self.json = tokenizer_json  # for the grammar engine's byte tables
        self.vocab_size = self._decoder.get_vocab_size(with_added_tokens=True)

        if noise_token_id is not None and not 0 <= noise_token_id < self.vocab_size:
            raise ChatFormatError(f"noise token id {noise_token_id} is outside the vocabulary (size {self.vocab_size})")
        self.special = SpecialTokens(
            bos=self._require(_config_token(config, "bos_token", BOS_TOKEN)),
            eos=self._require(_config_token(config, "eos_token", EOS_TOKEN)),
            pad=self._require(_config_token(config, "pad_token", PAD_TOKEN)),
            user=self._require(USER_TOKEN),
            assistant=self._require(ASSISTANT_TOKEN),
            think_start=self._require(THINK_START_TOKEN),
            think_end=self._require(THINK_END_TOKEN),
            image=self._require(IMAGE_TOKEN),
            system=self.token_id(SYSTEM_TOKEN),
            noise=noise_token_id,
            dsml=self.token_id(DSML),
        )

    @classmethod
    def from_dir(cls, path: str | Path, noise_token_id: int | None = None) -> Tokenizer:
        """Load ``tokenizer.json`` (and ``tokenizer_config.json`` if present) from a checkpoint dir."""
        path = Path(path)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else None
        return cls((path / "tokenizer.json").read_text(encoding="utf-8"), config, noise_token_id)

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` spelled exactly as in the vocabulary, or None."""
        return self._decoder.token_to_id(token)

    def _require(self, token: str) -> int:
        token_id = self.token_id(token)
        if token_id is None:
            raise ChatFormatError(f"tokenizer has no token {token!r}")
        return token_id

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as plain text (no BOS, special-token spellings not recognised).
        A long text goes through ``encode_batch``, which lets go of the GIL while it
        works (``encode`` holds it: 0.7 s for a 1 MiB text, every other thread of the
        process waiting); the ids are the same."""
        if len(text) < _GIL_FREE_CHARS:
            return self._plain.encode(text, add_special_tokens=False).ids
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token spells: a text of N bytes is at least N / this many tokens."""
        return max(len(self.token_bytes(token_id)) for token_id in range(self._decoder.get_vocab_size()))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its spelling in UTF-8)."""
        token = self._decoder.id_to_token(token_id)
        if token is None:
            raise ValueError(f"no token {token_id} in a vocabulary of {self.vocab_size}")
        if token_id in self._added:
            return token.encode("utf-8")
        try:  # byte-level BPE spells each byte as one printable character
            return bytes(_UNICODE_TO_BYTE[char] for char in token)
        except KeyError:
            return token.encode("utf-8")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self._decoder.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer over this vocabulary."""
        return IncrementalDetokenizer(self, skip_special_tokens)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable character for each byte (GPT-2's table), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_UNICODE_TO_BYTE = _byte_level_alphabet()


def _config_token(config: dict, key: str, default: str) -> str:
    # tokenizer_config.json spells a token either as a string or as an AddedToken dict.
    value = config.get(key) or default
    return value["content"] if isinstance(value, dict) else value


class IncrementalDetokenizer:
    """Turns ids arriving one by one into text pieces, never splitting a character.

    Contract: the concatenation of every ``push`` result and the final ``flush``
    equals ``tokenizer.decode(all_ids, skip_special_tokens)``.

    A piece is released only when the decoded text of the pending ids does not end
    in U+FFFD, i.e. its last UTF-8 sequence is complete; so every window start is
    a character boundary and decoding windows separately gives the same text as
    decoding the whole. Ids that really decode to U+FFFD at the end (invalid
    bytes) wait for the next id or for ``flush``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        # _ids[_prefix:_read] was already released and is re-decoded as context;
        # _ids[_read:] is pending.
        self._prefix = 0
        self._read = 0

    @property
    def ids(self) -> tuple[int, ...]:
        """Every id pushed so far."""
        return tuple(self._ids)

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became complete ("" if none)."""
        self._ids.append(token_id)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tokenizer.decode(self._ids[self._prefix :], self._skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Release whatever is pending, incomplete characters as U+FFFD."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tokenizer.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]


class EncodeMemo:
    """The ids of recently encoded texts, least recently used out first, bounded by
    their total number of tokens. Each turn of a conversation re-renders every earlier
    message (a 16K-token history is ~27 ms of tokenising); only the new text is new."""

    MIN_CHARS = 256  # shorter texts encode faster than they are worth keeping

    def __init__(self, tokenizer: Tokenizer, max_tokens: int):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.entries: OrderedDict[str, array] = OrderedDict()
        self.tokens = 0
        self._lock = threading.Lock()  # requests are rendered on several threads (not the encoding itself)

    def encode(self, text: str) -> Sequence[int]:
        if len(text) < self.MIN_CHARS:
            return self.tokenizer.encode(text)
        with self._lock:
            ids = self.entries.get(text)
            if ids is not None:
                self.entries.move_to_end(text)
                return ids
        ids = array("q", self.tokenizer.encode(text))
        if len(ids) <= self.max_tokens:
            with self._lock:
                if text not in self.entries:
                    self.entries[text] = ids
                    self.tokens += len(ids)
                while self.tokens > self.max_tokens:
                    self.tokens -= len(self.entries.popitem(last=False)[1])
        return ids
