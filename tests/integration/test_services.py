"""The pools' logic without Ray: prefill and decoder services over a real tiered store."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from actors.decoder import DecoderService, PrefixUnavailable
from actors.prefill import PrefillService
from actors.state import CachePlan, StateNaming
from model.runtime.engine import Engine
from model.loader import weights_digest
from model.runtime.sampling import SamplingParams
from model.runtime.serialize import StateIdentity
from storage.keys import Fingerprint
from storage.policy import RetentionPolicy
from storage.store import StoreConfig, TieredStore

pytestmark = pytest.mark.integration

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


def _run(engine, store, naming, tokens, n=12, in_process=False):
    prefill, decoder = PrefillService(engine, store, naming), DecoderService(engine, store, naming)
    handoff = prefill.prefill(_plan(naming, store, tokens), in_process=in_process)
    params = SamplingParams(temperature=0.0, max_tokens=n)
    events = [decoder.admit("r", handoff, params)]
    while decoder.running:
        events += decoder.step()
    decoder.write_pending()
    return handoff, [e.token_id for e in events]


def _greedy_tokens(engine, prompt, n):
    """``n`` greedy tokens after ``prompt``, in process: the cold run a service is held to."""
    cache = engine.new_cache()
    out = [int(engine.replay(cache, engine.prefill(cache, prompt)).argmax())]
    while len(out) < n:
        out.append(int(engine.decode([(cache, [out[-1]])])[0][-1].argmax()))
    return out


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
    assert warm_answer == _greedy_tokens(Engine(engine.model, engine.hasher, bounded_replay=False), second, 12)


def test_an_in_process_handoff_decodes_and_stores_like_a_serialized_one(pools, golden_prompts):
    engine, store, naming = pools
    first = golden_prompts[1][:90]
    prefill = PrefillService(engine, store, naming)
    plan = CachePlan(tuple(first), 0)
    answers = []
    for handoff in (prefill.prefill(plan), prefill.prefill(plan, in_process=True)):
        decoder = DecoderService(engine, store, naming)
        events = [decoder.admit("r", handoff, SamplingParams(temperature=0.0, max_tokens=12))]
        while decoder.running:
            events += decoder.step()
        answers.append([e.token_id for e in events])
    assert handoff.state == b"" and handoff.cache is not None
    with pytest.raises(TypeError, match="stays in the process"):
        pickle.dumps(handoff)
    assert answers[0] == answers[1]
    decoder.write_pending()  # the in-process request's conversation
    assert store.flush(timeout=10)
    warm, _ = _run(engine, store, naming, first + answers[1] + [3, 40, 21], n=2, in_process=True)
    assert warm.cached_tokens == len(first) + len(answers[1]) - 1


def _returning_handoff(engine, store, naming, history):
    """Turn one over ``history`` (stored), then the handoff of a returning turn."""
    _, answer = _run(engine, store, naming, history, n=2)
    assert store.flush(timeout=10)
    prompt = history + answer + [3, 40, 21, 1096]
    return PrefillService(engine, store, naming, node_id="n1").prefill(_plan(naming, store, prompt)), prompt


def test_a_returning_turns_handoff_names_the_stored_prefix_and_carries_only_the_rest(pools, golden_prompts):
    engine, store, naming = pools
    sizes, prefix_bytes = {}, {}
    for history in (golden_prompts[1][:80], (golden_prompts[2] * 2)[:560]):
        handoff, prompt = _returning_handoff(engine, store, naming, history)
        assert handoff.cached_tokens == len(prompt) - 5  # all but the new tokens (turn one's window state)
        assert handoff.stored_chunks == handoff.cached_tokens // CHUNK
        assert handoff.chunk_keys == tuple(naming.chunks(prompt)) and handoff.prefix_node == "n1"
        prefix = handoff.chunk_keys[: handoff.stored_chunks]
        sizes[len(history)] = len(handoff.state)
        prefix_bytes[len(history)] = sum(len(store.get(key)) for key in prefix)
    one_chunk = prefix_bytes[80] // (80 // CHUNK)
    # The stored prefix grew 7x; the handoff stayed the size of the new tokens, the
    # windows and the pending rows (it moved by less than one chunk's bytes).
    assert prefix_bytes[560] > 6 * prefix_bytes[80]
    assert abs(sizes[560] - sizes[80]) < one_chunk


def test_a_decoder_reads_a_prefix_it_lacks_from_the_node_that_served_it(pools, golden_prompts, tmp_path):
    engine, store, naming = pools
    handoff, prompt = _returning_handoff(engine, store, naming, golden_prompts[2][:170])
    params = SamplingParams(temperature=0.0, max_tokens=6)

    def decode(decoder, prefix=None):
        events = [decoder.admit("r", handoff, params, prefix)]
        while decoder.running:
            events += decoder.step()
        return [e.token_id for e in events]

    here = decode(DecoderService(engine, store, naming))
    elsewhere = TieredStore(StoreConfig(node_id="n2", retention=RetentionPolicy(ram_capacity_bytes=64 << 20)),
                            Fingerprint(naming.identity.model))
    handoff.prefix_node = "n1"
    try:
        with pytest.raises(PrefixUnavailable):
            decode(DecoderService(engine, elsewhere, naming))
        assert decode(DecoderService(engine, elsewhere, naming, peers={"n1": store}.get)) == here
        # What it fetched is now on its own node: the next decoder there needs no peer.
        assert decode(DecoderService(engine, elsewhere, naming)) == here
        # Chunks fetched beforehand (the pool's prefetch while the prefill runs), one
        # missing: it comes from the store.
        fetched = store.get_many(list(handoff.chunk_keys[: handoff.stored_chunks]))
        fetched[-1] = None
        assert decode(DecoderService(engine, elsewhere, naming), prefix=fetched) == here
    finally:
        elsewhere.close()


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
    # The exact restore (`exact_replay`: one window of tokens per layer) answers as a cold exact run.
    exact = Engine(engine.model, engine.hasher, bounded_replay=False, restore_windows=None)
    assert exact.exact_restore_tokens < warm.cached_tokens  # so the rerun is not the whole prefix
    again, tokens = _run(exact, store, naming, second, n=4)
    assert again.cached_tokens == warm.cached_tokens
    assert again.positions.tolist() == list(range(again.cached_tokens - exact.exact_restore_tokens, len(second)))
    assert tokens == _greedy_tokens(exact, second, 4)


def test_a_bounded_handoff_carries_the_streams_of_the_last_window_only(pools, golden_prompts):
    engine, store, naming = pools
    bounded = Engine(engine.model, engine.hasher, bounded_replay=True)
    prompt = (golden_prompts[2] * 2)[:300]
    handoff, tokens = _run(bounded, store, naming, prompt, n=6)
    window = engine.window
    assert handoff.positions.tolist() == list(range(300 - window, 300))
    assert handoff.streams.shape[0] == handoff.replay_ids.shape[0] == window
    # Not a view of the prompt's streams: pickled (to the decoder), it carries the window's only.
    streams = handoff.streams.numel() * handoff.streams.element_size()
    assert len(pickle.dumps(handoff)) < len(handoff.state) + 2 * streams
    assert tokens == _greedy_tokens(bounded, prompt, 6)  # the replay read only those anyway


def test_a_chunk_corrupted_on_disk_reads_as_a_miss(pools, golden_prompts, tmp_path):
    engine, store, naming = pools
    prompt = golden_prompts[2][:200]
    _run(engine, store, naming, prompt, n=2)
    assert store.flush(timeout=10)
    keys = naming.chunks(prompt)
    path = next((tmp_path / "ssd").rglob(keys[1].hex + "*"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit of the chunk's last scale byte, on disk
    path.write_bytes(bytes(data))
    # A store that reads from the SSD (no RAM copy), as after a restart.
    cold = TieredStore(StoreConfig(node_id="n1", ssd_dir=tmp_path / "ssd",
                                   retention=RetentionPolicy(ram_capacity_bytes=0)), Fingerprint(naming.identity.model))
    try:
        handoff = PrefillService(engine, cold, naming).prefill(CachePlan(tuple(prompt + [7]), len(keys)))
    finally:
        cold.close()
    assert handoff.stored_chunks == 1 and handoff.cached_tokens == CHUNK


@pytest.mark.slow
def test_speculative_decoder_gives_the_plain_tokens_and_a_reusable_conversation(tmp_path):
    """The small checkpoint's trained drafter in the decoder service (fixed k = 3):
    greedy tokens equal plain decoding, several tokens come out of one step, and the
    conversation it writes back serves the next turn like the plain one does."""
    from model.runtime.batcher import Speculation
    from model.loader import load_checkpoint, load_hasher
    from model.runtime.speculative import SpeculativeDrafter

    small = Path(__file__).resolve().parents[2] / "configs" / "small"
    checkpoint = load_checkpoint(small)
    identity = StateIdentity.of(checkpoint.config.text, weights_digest(small), "small-tokenizer")
    naming = StateNaming.of(identity, checkpoint.config.text, CHUNK)
    engine = Engine(checkpoint.backbone, load_hasher(small, checkpoint.config), bounded_replay=False)
    drafter = SpeculativeDrafter(checkpoint.drafter, engine)
    prompt = [1] + list(range(300, 380))  # any ids: the greedy tokens must agree either way
    follow = [17, 95, 23]
    runs = {}
    for name, speculation in (("plain", None), ("spec", Speculation(drafter, "fixed", k=3))):
        store = TieredStore(StoreConfig(node_id=name, ssd_dir=tmp_path / name), Fingerprint(identity.model))
        prefill = PrefillService(engine, store, naming)
        decoder = DecoderService(engine, store, naming, max_batch=4, speculation=speculation)
        answers, steps = [], 0
        for turn in range(2):
            tokens = prompt if turn == 0 else prompt + answers[0] + follow
            handoff = prefill.prefill(CachePlan(tuple(tokens), store.lookup_prefix(naming.chunks(tokens)).chunks))
            events = [decoder.admit("r", handoff, SamplingParams(temperature=0.0, max_tokens=24))]
            while decoder.running:
                events += decoder.step()
                steps += 1
            decoder.write_pending()
            assert store.flush(timeout=10)
            answers.append([e.token_id for e in events])
            if turn == 1:
                assert handoff.cached_tokens == len(prompt) + len(answers[0]) - 1
        runs[name] = (answers, steps, decoder.spec_metrics)
        store.close()
    assert runs["spec"][0] == runs["plain"][0]
    assert runs["plain"][2] is None
    metrics = runs["spec"][2]
    # k = 3 guesses a step, fewer only where max_tokens leaves less room.
    assert metrics.passes == runs["spec"][1] and max(metrics.verify_lengths) == 3
    assert runs["spec"][1] < runs["plain"][1]  # some guesses were accepted


class _CountingStore:
    """The tiered store, counting the calls that reach it."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def get_many(self, keys):
        self.calls.append(len(keys))
        return self.store.get_many(keys)

    def put(self, key, payload):
        self.store.put(key, payload)


def test_the_plans_window_list_spares_store_calls(pools, golden_prompts):
    engine, store, naming = pools
    first = golden_prompts[2][:170]
    _, answer = _run(engine, store, naming, first)
    assert store.flush(timeout=10)
    second = first + answer + [3, 40, 21]
    counting = _CountingStore(store)
    prefill = PrefillService(engine, counting, naming)
    chunks = store.lookup_prefix(naming.chunks(second)).chunks
    usable = min(chunks, (len(second) - 1) // CHUNK)
    stored = [(n, key) for n, key in naming.window_candidates(second[:-1], usable * CHUNK) if store.get(key)]
    assert [n for n, _ in stored] == [len(first) + len(answer) - 1]
    # The router's index knew the window: chunks and window in one call of 1 + usable keys.
    warm = prefill.prefill(CachePlan(tuple(second), chunks, (), tuple(stored)))
    assert counting.calls == [usable + 1] and warm.cached_tokens == stored[0][0]
    # No index answer: every candidate is probed (same result).
    counting.calls.clear()
    probed = prefill.prefill(CachePlan(tuple(second), chunks))
    assert counting.calls[0] > usable + 1 and probed.cached_tokens == warm.cached_tokens
    assert probed.state == warm.state
    # The index knows of nothing for a new prompt: no store call at all.
    counting.calls.clear()
    cold = prefill.prefill(CachePlan(tuple(golden_prompts[1][:40]), 0, (), ()))
    assert counting.calls == [] and cold.cached_tokens == 0


def test_a_client_gone_while_its_admission_waits_leaves_no_request_in_the_batch(pools, golden_prompts):
    """The decoder pool's queueing (without Ray): a batch of one place. Request a takes the
    place and its admission starts on the engine thread, slowly (an injected stall, as on a
    starved machine); its client leaves. Request b must then get the place and be admitted:
    before, a's finally saw a not yet in the batch and freed the place, a's admission then
    put it in the batch, and b found the batch full (a 503 in the 64-client test under load)."""
    import asyncio
    import threading

    engine, store, naming = pools
    pool = _pool_without_ray(engine, store, naming, max_batch=1)
    prefill = PrefillService(engine, store, naming)
    params = SamplingParams(temperature=0.0, max_tokens=8)

    stall = threading.Event()

    def admission(request_id):
        handoff = prefill.prefill(CachePlan(tuple(golden_prompts[0][:40]), 0), in_process=True)

        def admit():
            if request_id == "a":
                stall.wait(30)
            return handoff, pool.service.admit(request_id, handoff, params)
        return admit

    async def first_event(request_id):
        events = pool._decode(request_id, admission(request_id))
        try:
            return await events.__anext__()
        finally:
            await events.aclose()

    async def scenario():
        pool.slots = asyncio.Semaphore(1)
        gone = asyncio.create_task(first_event("a"))
        await asyncio.sleep(0.2)  # a has the place; its admission runs on the engine thread
        gone.cancel()  # its client leaves
        later = asyncio.create_task(first_event("b"))
        await asyncio.sleep(0.2)
        stall.set()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return await asyncio.wait_for(later, 60)

    try:
        (event,) = asyncio.run(scenario()).tokens
    finally:
        pool.executor.shutdown(wait=True)
    assert event.admission.prompt_tokens == 40 and event.finish_reason is None
    assert pool.service.running == 0  # both left the batch: a cancelled, b closed after its first token


def _pool_without_ray(engine, store, naming, max_batch: int):
    """A decoder replica's :class:`actors.decoder.DecoderPool` built without Serve (its
    queueing and streaming, on this process's event loop)."""
    from actors.decoder import DecoderPool
    from actors.metrics import DecoderMetrics, LoopStats
    from actors.replica import one_thread_executor

    pool = object.__new__(DecoderPool.func_or_class)
    pool.service = DecoderService(engine, store, naming, max_batch=max_batch)
    pool.executor, pool.queues, pool.queued, pool.stepping, pool.node_id = one_thread_executor(), {}, 0, None, "n1"
    pool.metrics, pool.loop_counts = DecoderMetrics(), LoopStats()
    return pool


def test_a_reader_that_falls_behind_gets_the_steps_tokens_together_in_order(pools, golden_prompts):
    """The engine steps on while a request's stream is not read: the next item carries
    every token made since the last one (one item per step while the reader keeps up),
    and the tokens are those of plain greedy decoding."""
    import asyncio

    engine, store, naming = pools
    prompt = golden_prompts[0][:40]
    cache = engine.new_cache()
    logits = engine.replay(cache, engine.prefill(cache, prompt))
    greedy = [int(logits.argmax())]
    for _ in range(11):
        greedy.append(int(engine.decode([(cache, [greedy[-1]])])[0][-1].argmax()))

    pool = _pool_without_ray(engine, store, naming, max_batch=2)
    prefill = PrefillService(engine, store, naming)
    params = SamplingParams(temperature=0.0, max_tokens=64)

    def admit():
        handoff = prefill.prefill(CachePlan(tuple(prompt), 0), in_process=True)
        return handoff, pool.service.admit("r", handoff, params)

    async def read() -> list[tuple[int, ...]]:
        pool.slots = asyncio.Semaphore(2)
        items, events = [], pool._decode("r", admit)
        try:
            while sum(len(item) for item in items) < 12:
                items.append(tuple(token.token_id for token in (await events.__anext__()).tokens))
                if len(items) == 2:  # behind: the engine makes several tokens meanwhile
                    await asyncio.sleep(0.5)
        finally:
            await events.aclose()
        return items

    try:
        items = asyncio.run(read())
    finally:
        pool.executor.shutdown(wait=True)
    tokens = [token for item in items for token in item]
    assert tokens[:12] == greedy
    assert len(items[0]) == 1  # the first token, alone (its admission)
    assert len(items[2]) > 1  # what the steps made while the reader slept
    assert pool.loop_counts.tokens >= len(tokens) - 1 and pool.loop_counts.items == len(items)
    assert pool.service.running == 0  # the closed stream left the batch


class SlowLink:
    """A node's store behind a link of ``rate`` bytes/s (the fault a test injects)."""

    def __init__(self, store: TieredStore, rate: float) -> None:
        self.store, self.rate = store, rate

    def get_many(self, keys):
        import time

        blobs = self.store.get_many(keys)
        time.sleep(sum(len(blob) for blob in blobs if blob) / self.rate)
        return blobs


@pytest.mark.parametrize("rate, moved", [(4e3, False), (1e9, True)])
def test_a_prefix_on_another_node_is_moved_or_encoded_again_by_measured_cost(pools, golden_prompts, tmp_path,
                                                                          rate, moved):
    engine, store, naming = pools
    _, prompt = _returning_handoff(engine, store, naming, golden_prompts[2][:170])
    plan = _plan(naming, store, prompt)
    plan = CachePlan(plan.token_ids, plan.cached_chunks, nodes=("n1",))
    cost, handoffs = None, []
    for attempt in range(2):  # the first read from n1 measures the link; the second decides by it
        here = TieredStore(StoreConfig(node_id="n2", ssd_dir=tmp_path / f"n2-{rate}-{attempt}",
                                       retention=RetentionPolicy(ram_capacity_bytes=64 << 20)),
                           Fingerprint(naming.identity.model))
        try:
            service = PrefillService(engine, here, naming, node_id="n2", peers={"n1": SlowLink(store, rate)}.get)
            service.cost = cost or service.cost
            cost = service.cost
            handoffs.append(service.prefill(plan))
        finally:
            here.close()
    first, second = handoffs
    # (4 KB/s: moving ~19 KB takes ~5 s, encoding their 160 tokens well under one even on
    # a busy machine; a faster "slow" link let a loaded CI machine's encoding catch up)
    assert first.cached_tokens > 0 and first.moved_bytes > 0 and first.recomputed_tokens == 0
    move_s, encode_s = cost.estimate("n1", plan.cached_chunks, CHUNK)
    assert (move_s <= encode_s) == moved
    if moved:
        assert second.cached_tokens == first.cached_tokens and second.recomputed_tokens == 0
        assert cost.choices == {"moved": 2}
    else:  # nothing read across the slow link: every stored chunk encoded again, the same tokens
        assert second.cached_tokens == 0 and second.moved_bytes == 0
        assert second.recomputed_tokens == naming.loadable_chunks(plan) * CHUNK
        assert cost.choices["moved"] == 1 and cost.choices["recomputed"] >= 1  # (chunks, then the windows)
    decoder = DecoderService(engine, store, naming)
    events = [decoder.admit("r", second, SamplingParams(temperature=0.0, max_tokens=6))]
    while decoder.running:
        events += decoder.step()
    assert [e.token_id for e in events] == _greedy_tokens(Engine(engine.model, engine.hasher, bounded_replay=False),
                                                          prompt, 6)
