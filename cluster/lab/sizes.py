"""Byte sizes of stored objects, from the project's own serialisation of a model config.

:func:`from_config` builds a sequence cache of the configured model's layout (zeros: the
sizes do not depend on the values), serialises one chunk and one window state with
``model.runtime.serialize`` and adds the store's envelope (``storage.codec``): the bytes
a store would hold for that model. With the released V4.1-Flash config a 128-token chunk
is 890 B/token of rows plus two headers, and a window state holds 40 layers x 128 tokens
of FP8 window rows plus the tail past the last chunk.

:data:`V4_FLASH` is the size profile of DeepSeek V4-Flash, whose policy persisted window
states to SSD with the chunks. Its numbers are not derived here (there is no V4 layout
in this project); their sources:

- long-range cache 3,560 B/token: the seed article ("about 3.6 KB", "about 4x V4.1");
  the public V4-Flash shape gives 3.1-3.8 KB depending on dtypes (21 CSA ratio-4 layers
  with indexer keys, 20 HCA ratio-128 layers);
- window state 43 layers x 128 tokens x 512 B (FP8) = 2,818,048 B per snapshot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RELEASED_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "deepseek-v4.1-flash"


@dataclass(frozen=True)
class Sizes:
    """What one stored chunk (``chunk_tokens`` tokens) and one window state cost."""

    name: str
    chunk_tokens: int
    chunk_bytes: int
    window_bytes: int
    persist_windows: bool  # the policy: window states to SSD too (V4), or RAM only (V4.1)
    source: str

    @property
    def chunk_bytes_per_token(self) -> float:
        return self.chunk_bytes / self.chunk_tokens

    def as_dict(self) -> dict:
        return {"name": self.name, "chunk_tokens": self.chunk_tokens, "chunk_bytes": self.chunk_bytes,
                "window_bytes": self.window_bytes, "persist_windows": self.persist_windows,
                "chunk_bytes_per_token": round(self.chunk_bytes_per_token, 2), "source": self.source}


def from_config(config_dir: str | Path = RELEASED_CONFIG, chunk_tokens: int = 128) -> Sizes:
    """Sizes of a V4.1 model's objects: a chunk of ``chunk_tokens`` tokens, and a window
    state whose tail past its last chunk is half a chunk (the mean over where a
    conversation's turn ends: the tail's size is linear in its length)."""
    import torch

    from model.config import ModelConfig
    from model.runtime.cache import SequenceCache
    from model.runtime.serialize import StateIdentity, chunk_granularity, chunk_to_bytes, window_to_bytes
    from storage.codec import HEADER_BYTES

    config_path = Path(config_dir) / "config.json"
    text = ModelConfig.from_dict(json.loads(config_path.read_text())).text
    granularity = chunk_granularity(text)
    if chunk_tokens % granularity:
        raise ValueError(f"chunk_tokens must be a multiple of {granularity} for this config")
    identity = StateIdentity.of(text, b"", "sizes")

    def cache_of(length: int) -> SequenceCache:
        cache = SequenceCache.empty(text)
        for plan in text.layer_plans():
            if plan.is_kv_source:
                for rows in (cache.entries[plan.index], cache.keys[plan.index]):
                    rows.append_bytes(torch.zeros(length // plan.compress_ratio, rows.row_bytes, dtype=torch.uint8))
                cache.pending[plan.index] = torch.zeros(length % plan.compress_ratio, text.hidden_size)
        for layer in range(text.num_hidden_layers):
            window = cache.new_window(layer, max(0, length - text.sliding_window))
            window.rows.append_bytes(torch.zeros(min(length, text.sliding_window), window.rows.row_bytes,
                                                 dtype=torch.uint8))
        cache.length = length
        return cache

    chunk = len(chunk_to_bytes(cache_of(chunk_tokens), 0, chunk_tokens, identity)) + HEADER_BYTES
    # Window states at a chunk boundary and just before the next one; their mean is the
    # size at half a chunk of tail (linear in the tail, up to the pooling remainders).
    ends = [4 * chunk_tokens, 5 * chunk_tokens - 1]
    windows = [len(window_to_bytes(cache_of(end), 4 * chunk_tokens, identity)) + HEADER_BYTES for end in ends]
    return Sizes(f"V4.1 ({config_path.parent.name})", chunk_tokens, chunk, round(sum(windows) / 2), False,
                 f"model.runtime.serialize of {config_path} + storage.codec envelope")


V4_FLASH_BYTES_PER_TOKEN = 3560
V4_FLASH_WINDOW_BYTES = 43 * 128 * 512


def v4_flash(chunk_tokens: int = 128) -> Sizes:
    """DeepSeek V4-Flash's stored objects (see the module docstring for the sources)."""
    from storage.codec import HEADER_BYTES

    return Sizes("V4-Flash", chunk_tokens, V4_FLASH_BYTES_PER_TOKEN * chunk_tokens + HEADER_BYTES,
                 V4_FLASH_WINDOW_BYTES + HEADER_BYTES, True,
                 "seed article (3,560 B/token long-range) and 43 layers x 128 x 512 B FP8 windows")
