"""Conversations a decoder replica keeps for their next turn (actors/resident.py): the
next turn starts from the kept cache and decodes, and stores, what it would have read
from the store; the memory they take stays within the budget."""

from __future__ import annotations

import pytest
import torch

from actors.decoder import DecoderService
from actors.prefill import PrefillService
from actors.resident import ResidentConversations
from actors.state import CachePlan, StateNaming
from model.loader import weights_digest
from model.runtime.engine import Engine
from model.runtime.sampling import SamplingParams
from model.runtime.serialize import StateIdentity
from storage.keys import Fingerprint
from storage.policy import RetentionPolicy
from storage.store import StoreConfig, TieredStore

pytestmark = pytest.mark.unit

CHUNK = 32


def _store(identity, path):
    return TieredStore(StoreConfig(node_id="n1", ssd_dir=path, retention=RetentionPolicy(ram_capacity_bytes=64 << 20)),
                       Fingerprint(identity.model))


@pytest.fixture()
def parts(golden_model, golden_hasher, golden_dir, tmp_path):
    config, model = golden_model
    identity = StateIdentity.of(config.text, weights_digest(golden_dir), "golden-tokenizer")
    naming = StateNaming.of(identity, config.text, CHUNK)
    stores = [_store(identity, tmp_path / name) for name in ("resident", "stored")]
    yield Engine(model, golden_hasher, bounded_replay=False), naming, stores
    for store in stores:
        store.close()


def _turn(engine, store, naming, decoder, tokens, resident_key=None, n=8):
    """One request through the decoder's own prefill (as ``prefill_and_generate`` does):
    from the kept conversation ``resident_key`` if given, else from the store. Returns
    (handoff, tokens, first-token logprobs, the name it keeps the conversation under)."""
    match = store.lookup_prefix(naming.chunks(tokens))
    plan = CachePlan(tuple(tokens), match.chunks)
    start = decoder.resident.take(resident_key, tokens) if resident_key is not None else None
    handoff = PrefillService(engine, store, naming).prefill(plan, in_process=True, resident=start)
    params = SamplingParams(temperature=0.0, max_tokens=n, logprobs=5)
    events = [decoder.admit("r", handoff, params)]
    while decoder.running:
        events += decoder.step()
    objects = decoder.conversation_objects("r")
    for key, payload in objects:
        store.put(key, payload)
    assert store.flush(timeout=10)
    return handoff, [e.token_id for e in events], events[0].top_logprobs, decoder.keep_resident("r"), objects


def test_a_turn_resumed_from_the_kept_cache_equals_one_read_from_the_store(parts, golden_prompts):
    engine, naming, (kept_store, read_store) = parts
    history = (golden_prompts[2] * 2)[:300]
    runs = {}
    for name, store, budget in (("resident", kept_store, 1 << 30), ("stored", read_store, 0)):
        decoder = DecoderService(engine, store, naming, resident_bytes=budget)
        _, answer, _, key, _ = _turn(engine, store, naming, decoder, history)
        assert (key is not None) == (name == "resident")
        prompt = history + answer + [3, 40, 21, 1096, 48, 4, 5]
        runs[name] = (prompt, *_turn(engine, store, naming, decoder, prompt, key))
    (prompt, resumed, tokens, top, _, objects), (prompt_s, stored, tokens_s, top_s, _, objects_s) = \
        runs["resident"], runs["stored"]
    assert prompt == prompt_s
    # Both read the whole history but the answer's last token (never fed): one from the
    # kept cache, the other from the chunks and window state stored after turn one.
    assert resumed.cached_tokens == stored.cached_tokens == len(prompt) - 8
    assert resumed.moved_bytes == 0 and resumed.stored_chunks == stored.stored_chunks
    # The same computation on the same values (the kept rows are the stored rows'
    # dequantised values; the windows and pending rows are stored exactly): the same
    # answer and first-token log-probabilities, and byte-equal objects for the store.
    assert tokens == tokens_s
    assert [t for t, _ in top] == [t for t, _ in top_s]
    assert torch.allclose(torch.tensor([p for _, p in top]), torch.tensor([p for _, p in top_s]), atol=1e-5)
    assert [key for key, _ in objects] == [key for key, _ in objects_s]
    assert all(a == b for (_, a), (_, b) in zip(objects, objects_s))


def test_kept_conversations_stay_within_the_budget_and_are_taken_once(parts, golden_prompts):
    engine, naming, (store, _) = parts
    decoder = DecoderService(engine, store, naming, resident_bytes=1 << 30)
    prompts = [golden_prompts[i][:120] for i in range(3)]
    kept = []
    for prompt in prompts:
        _, answer, _, key, _ = _turn(engine, store, naming, decoder, prompt, n=4)
        kept.append((key, prompt + answer[:-1]))
    sizes = [decoder.resident._held[key].nbytes for key, _ in kept]
    assert all(size > 0 for size in sizes)
    assert decoder.resident.stats().bytes == sum(sizes)
    # Room for the last two only: the first kept is the first dropped.
    room = ResidentConversations(sizes[1] + sizes[2])
    for (key, tokens), size in zip(kept, sizes):
        room.keep(key, tokens, decoder.resident._held[key].cache)
    stats = room.stats()
    assert (stats.conversations, stats.bytes, stats.evicted) == (2, sizes[1] + sizes[2], 1)
    assert kept[0][0] not in room and kept[2][0] in room
    # One larger than the budget is not kept at all.
    first_cache = decoder.resident._held[kept[0][0]].cache
    assert not ResidentConversations(sizes[0] - 1).keep(kept[0][0], kept[0][1], first_cache)

    key, tokens = kept[2]
    # A prompt that adds nothing to encode leaves it kept; one that does not continue it
    # drops it; one that continues it takes it, once.
    assert room.take(key, tokens) is None and key in room
    assert room.take(kept[1][0], list(kept[1][1][:-1]) + [7, 8]) is None and kept[1][0] not in room
    cache = room.take(key, tokens + [5])
    assert cache is not None and cache.length == len(tokens)
    assert room.take(key, tokens + [5]) is None
    stats = room.stats()
    assert (stats.conversations, stats.bytes, stats.resumed, stats.missed) == (0, 0, 1, 3)
    with pytest.raises(ValueError, match="kept as the state after"):
        room.keep(key, tokens[:-1], cache)


def test_a_conversation_whose_client_left_is_not_kept(parts, golden_prompts):
    engine, naming, (store, _) = parts
    decoder = DecoderService(engine, store, naming, resident_bytes=1 << 30)
    prompt = golden_prompts[1][:70]
    handoff = PrefillService(engine, store, naming).prefill(CachePlan(tuple(prompt), 0), in_process=True)
    decoder.admit("r", handoff, SamplingParams(temperature=0.0, max_tokens=3))
    while decoder.running:
        decoder.step()
    decoder.forget("r")  # finished, but the client left before the last token
    assert decoder.keep_resident("r") is None and decoder.resident.stats().conversations == 0
