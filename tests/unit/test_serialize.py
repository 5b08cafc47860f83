"""Chunks and window states as bytes: bit-exact round trips, every corruption detected."""

from __future__ import annotations

import dataclasses
import pytest
import torch

from model.config import ModelConfig
from model.runtime.engine import Engine
from model.engram import EngramLayout, NgramHasher
from model.loader import load_tokenizer
from model.runtime.serialize import (
    HEADER_BYTES,
    StateError,
    StateIdentity,
    chunk_granularity,
    chunk_to_bytes,
    load_chunk,
    load_chunks,
    load_window,
    window_to_bytes,
)
from model.transformer import Transformer

pytestmark = pytest.mark.unit

TINY = "configs/tiny"
CHUNK = 32


@pytest.fixture(scope="module")
def setup():
    config = ModelConfig.load(TINY).text
    model = Transformer(config).init_weights(seed=5, std=0.08).eval()
    hasher = NgramHasher.from_tokenizer(EngramLayout.from_config(config), load_tokenizer(TINY))
    engine = Engine(model, hasher, bounded_replay=True)
    identity = StateIdentity.of(config, b"weights-A", "tokenizer-A")
    prompt = torch.randint(3, 2000, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = engine.new_cache()
    first = int(engine.replay(cache, engine.prefill(cache, prompt)).argmax())
    return engine, identity, cache, first


def _serialize(cache, identity):
    whole = cache.length // CHUNK * CHUNK
    chunks = [chunk_to_bytes(cache, s, CHUNK, identity) for s in range(0, whole, CHUNK)]
    return chunks, window_to_bytes(cache, whole, identity)


def _rebuild(engine, chunks, window, identity):
    cache = engine.new_cache()
    for blob in chunks:
        load_chunk(cache, blob, identity)
    load_window(cache, window, identity)
    return cache


def test_granularity_of_configs():
    assert chunk_granularity(ModelConfig.load(TINY).text) == 4  # ratio 2, candidate block 4
    assert chunk_granularity(ModelConfig.load("configs/deepseek-v4.1-flash").text) == 8


def test_round_trip_is_bit_exact_and_decodes_identically(setup):
    engine, identity, cache, first = setup
    chunks, window = _serialize(cache, identity)
    rebuilt = _rebuild(engine, chunks, window, identity)
    assert rebuilt.length == cache.length
    again_chunks, again_window = _serialize(rebuilt, identity)
    assert again_chunks == chunks and again_window == window
    original = [first]
    copy = [first]
    for _ in range(6):
        original.append(int(engine.decode([(cache, [original[-1]])])[0][-1].argmax()))
        copy.append(int(engine.decode([(rebuilt, [copy[-1]])])[0][-1].argmax()))
    assert copy == original


def test_chunks_alone_restore_through_the_encoder_replay(setup):
    engine, identity, _, _ = setup
    prompt = torch.randint(3, 2000, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = engine.new_cache()
    engine.replay(cache, engine.prefill(cache, prompt))
    chunks = [chunk_to_bytes(cache, s, CHUNK, identity) for s in range(0, 96, CHUNK)]
    restored = engine.new_cache()
    for blob in chunks:
        load_chunk(restored, blob, identity)
    assert restored.long_range_bytes() == cache.long_range_bytes()
    logits = engine.replay(restored, engine.restore(restored, prompt).then(engine.prefill(restored, [5, 6])))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("damage", ["flip_position", "flip_layout", "truncate", "extend"])
def test_malformed_objects_are_refused_and_change_nothing(setup, damage):
    """What this layer checks. Flipped payload bits are the store's to catch: every
    object in a storage tier is sealed by storage.codec (tests/unit/test_store_keys.py
    flips every header bit and hundreds of payload bits of an envelope)."""
    engine, identity, cache, _ = setup
    chunks, window = _serialize(cache, identity)
    for blob, load in ((chunks[0], load_chunk), (window, None)):
        bad = bytearray(blob)
        if damage == "flip_position":
            bad[16] ^= 0x01  # the first token position
        elif damage == "flip_layout":
            bad[9] ^= 0x01
        elif damage == "truncate":
            bad = bad[: len(bad) - 3]
        else:
            bad += b"\0"
        target = engine.new_cache()
        if load is None:  # the window state goes onto a cache holding the chunks
            for c in chunks:
                load_chunk(target, c, identity)
        before = (target.length, target.long_range_bytes())
        with pytest.raises(StateError):
            (load or load_window)(target, bytes(bad), identity)
        assert (target.length, target.long_range_bytes()) == before


def test_foreign_layout_kind_or_order_is_rejected(setup):
    engine, identity, cache, _ = setup
    chunks, window = _serialize(cache, identity)
    other = dataclasses.replace(identity, layout=bytes(16))
    with pytest.raises(StateError, match="another cache layout"):
        load_chunk(engine.new_cache(), chunks[0], other)
    with pytest.raises(StateError, match="starts at"):
        load_chunk(engine.new_cache(), chunks[1], identity)  # out of order
    # What kind an object is, the store's envelope says (an object under a window key
    # is a window); a chunk's bytes read as a window state simply do not parse.
    with pytest.raises(StateError):
        load_window(engine.new_cache(), chunks[0], identity)


def test_an_object_of_an_earlier_layout_reads_as_a_miss(setup):
    """Layout 2 began with its own envelope (magic, version, kind, the layout, the
    positions): such an object, still in a tier after an upgrade, is refused."""
    import struct

    engine, identity, cache, _ = setup
    chunks, _ = _serialize(cache, identity)
    old = struct.pack("<4sHBx16sqq", b"V41S", 2, 1, identity.layout, 0, CHUNK) + chunks[0][HEADER_BYTES:]
    with pytest.raises(StateError, match="another cache layout"):
        load_chunk(engine.new_cache(), old, identity)


def test_chunks_loaded_together_equal_chunks_loaded_one_by_one(setup):
    """The prefill's batched load: same rows, values and length as chunk after chunk,
    and it stops at the first chunk that does not verify, keeping those before it."""
    engine, identity, cache, _ = setup
    chunks, _ = _serialize(cache, identity)
    one_by_one = engine.new_cache()
    for blob in chunks:
        load_chunk(one_by_one, blob, identity)
    together = engine.new_cache()
    assert load_chunks(together, chunks, identity) == len(chunks) == 4
    assert together.length == one_by_one.length == 4 * CHUNK
    assert together.long_range_bytes() == one_by_one.long_range_bytes()
    for stores, expected in ((together.entries, one_by_one.entries), (together.keys, one_by_one.keys)):
        assert stores.keys() == expected.keys()
        for layer, rows in stores.items():
            assert torch.equal(rows.values, expected[layer].values) and torch.equal(rows.data, expected[layer].data)
    bad = chunks[2][:-3]  # truncated
    partial = engine.new_cache()
    assert load_chunks(partial, [chunks[0], chunks[1], bad, chunks[3]], identity) == 2
    two = engine.new_cache()
    for blob in chunks[:2]:
        load_chunk(two, blob, identity)
    assert partial.length == 2 * CHUNK and partial.long_range_bytes() == two.long_range_bytes()
    assert load_chunks(engine.new_cache(), [chunks[1]], identity) == 0  # out of order: nothing
    assert load_chunks(engine.new_cache(), [], identity) == 0
