"""The pools' logic without Ray: prefill and decoder services over a real tiered store."""

from __future__ import annotations

import pytest
import torch

from actors.decoder import DecoderService
from actors.prefill import PrefillService
from actors.state import CachePlan, StateNaming
from model.engine import Engine
from model.loader import weights_digest
from model.sampling import SamplingParams
from model.serialize import StateIdentity
from storage.keys import Fingerprint
from storage.policy import RetentionPolicy
from storage.store import StoreConfig, TieredStore

CHUNK = 32


@pytest.fixture()
def pools(golden_model, golden_hasher, golden_dir, tmp_path):
    config, model = golden_model
    identity = StateIdentity.of(config.text, weights_digest(golden_dir), "golden-tokenizer")
    naming = StateNaming.of(identity, config.text, CHUNK)
    store = TieredStore(StoreConfig(node_id="n1", ssd_dir=tmp_path / "ssd",
                                    retention=RetentionPolicy(ram_capacity_bytes=64 << 20)),
                        Fingerprint(identity.model))
    engine = Engine(model, golden_hasher, bounded_replay=False)
    yield engine, store, naming
    store.close()


def _plan(naming, store, tokens):
    match = store.lookup_prefix(naming.chunks(tokens))
    return CachePlan(tuple(tokens), match.chunks)


def _run(engine, store, naming, tokens, n=12):
    prefill, decoder = PrefillService(engine, store, naming), DecoderService(engine, store, naming)
    handoff = prefill.prefill(_plan(naming, store, tokens))
    params = SamplingParams(temperature=0.0, max_tokens=n)
    events = [decoder.admit("r", handoff, params)]
    while decoder.running:
        events += decoder.step()
    decoder.write_pending()
    return handoff, [e.token_id for e in events]


def test_second_turn_reads_the_cache_and_matches_a_cold_exact_run(pools, golden_prompts):
    engine, store, naming = pools
    first = golden_prompts[2][:170]
    handoff, answer = _run(engine, store, naming, first)
    assert handoff.cached_tokens == 0
    assert store.flush(timeout=10)
    follow = [3, 40, 21, 1096, 48, 4, 5, 6]
    second = first + answer + follow
    warm, warm_answer = _run(engine, store, naming, second)
    assert warm.cached_tokens == len(first) + len(answer) - 1  # the window state of turn one
    cold_engine = Engine(engine.model, engine.hasher, bounded_replay=False)
    cache = cold_engine.new_cache()
    logits = cold_engine.replay(cache, cold_engine.prefill(cache, second))
    cold = [int(logits.argmax())]
    for _ in range(11):
        cold.append(int(cold_engine.decode([(cache, [cold[-1]])])[0][-1].argmax()))
    assert warm_answer == cold


def test_expired_window_state_falls_back_to_the_encoder_replay(pools, golden_prompts):
    engine, store, naming = pools
    first = golden_prompts[2][:170]
    _, answer = _run(engine, store, naming, first)
    store.flush(timeout=10)
    second = first + answer + [3, 40, 21]
    store.remove(naming.window(first + answer[:-1]))  # the window state expired
    warm, tokens = _run(engine, store, naming, second, n=4)
    assert warm.cached_tokens == (len(first) + len(answer) - 1) // CHUNK * CHUNK
    assert warm.stored_chunks == warm.cached_tokens // CHUNK and len(tokens) == 4


def test_corrupt_chunk_reads_as_a_miss(pools, golden_prompts):
    engine, store, naming = pools
    prompt = golden_prompts[2][:200]
    _run(engine, store, naming, prompt, n=2)
    store.flush(timeout=10)
    keys = naming.chunks(prompt)
    blob = bytearray(store.get(keys[1]))
    blob[-1] ^= 0xFF
    store.put(keys[1], bytes(blob))  # well-enveloped bytes of a bad chunk
    prefill = PrefillService(engine, store, naming)
    handoff = prefill.prefill(CachePlan(tuple(prompt + [7]), len(keys)))
    assert handoff.stored_chunks == 1 and handoff.cached_tokens == CHUNK
