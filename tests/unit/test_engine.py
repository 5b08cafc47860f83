"""The engine against the reference forward: exact paths agree, bounded paths run, batches
equal singles, expired windows are rebuilt."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from model.runtime.engine import Engine

pytestmark = pytest.mark.unit

TINY = "configs/tiny"


@pytest.fixture(scope="module")
def tiny(tiny_backbone):
    """The tiny config (every mechanism) with random weights, and its hasher."""
    _, model, hasher = tiny_backbone
    return model, hasher


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(model, hasher, tokens, memories: list | None = None):
    """Reference logits [S, V]; with ``memories``, also capture its long-range state."""
    from model import transformer

    ids = torch.tensor([tokens])
    original = transformer.SequenceMemory
    if memories is not None:
        transformer.SequenceMemory = lambda: memories.append(original()) or memories[-1]
    try:
        return model(ids, hasher.hash_ids(ids)[0])[0]
    finally:
        transformer.SequenceMemory = original


def _greedy(engine, tokens, steps):
    cache = engine.new_cache()
    logits = [engine.replay(cache, engine.prefill(cache, tokens))]
    out = []
    for _ in range(steps):
        out.append(int(logits[-1].argmax()))
        logits.append(engine.decode([(cache, [out[-1]])])[0][-1])
    return out, torch.stack(logits), cache


def test_exact_engine_equals_reference_at_every_position(tiny):
    model, hasher = tiny
    engine = Engine(model, hasher, bounded_replay=False)
    prompt = _tokens(150, 0)  # 150 > window 32 + top-k 16 entries: sparse everywhere
    forced = _tokens(12, 1)
    cache = engine.new_cache()
    logits = [engine.replay(cache, engine.prefill(cache, prompt))]
    logits += [engine.decode([(cache, [t])])[0][-1] for t in forced]
    memories = []
    reference = _reference(model, hasher, prompt + forced, memories)[len(prompt) - 1 :]
    assert cache.length == len(prompt) + len(forced)
    # The engine and the reference multiply in different orders (one token at a time,
    # gathered places, chunks), so a cache value on an FP4/FP8 rounding boundary may
    # round the other way: the entries agree but for a few rows, by one code step, and
    # the logits by what such a flip carries forward (random weights are chaotic:
    # ~0.2 on an AMD EPYC, 0.004 on an Intel Xeon with AVX-512). The float-cache configurations of
    # test_config_sweep hold the same paths to 1e-4; the golden checkpoint to 1e-4.
    for source, rows in cache.entries.items():
        expected = memories[0].entries[source][0]
        assert rows.values.shape == expected.shape
        differing = (rows.values - expected).abs().amax(-1) > 0
        assert differing.float().mean() < 0.15
        step = expected.abs().amax(-1, keepdim=True) / 6 * 2  # two FP4 codes at the row's largest scale
        assert ((rows.values - expected).abs() <= step).all()
        assert cache.keys[source].values.shape == memories[0].keys[source][0].shape
    assert (torch.stack(logits) - reference).abs().max() < 0.5


def test_exact_engine_reproduces_golden_generations(golden_model, golden_hasher, golden_dir):
    _, model = golden_model
    engine = Engine(model, golden_hasher, bounded_replay=False)
    steps = load_file(golden_dir / "generation_step_logits.safetensors")
    for result in json.loads((golden_dir / "generation.json").read_text())["results"]:
        prompt = result["full_sequence"][: result["prompt_len"]]
        generated, logits, _ = _greedy(engine, prompt, 20)
        assert generated == result["new_tokens"]
        assert (logits[:20] - steps[f"gen_step_logits_p{result['prompt_index']}"]).abs().max() < 1e-4


def test_prefill_in_turns_with_live_windows_is_exact(golden_model, golden_hasher, golden_prompts):
    """A returning turn whose windows are still in RAM extends every cache exactly,
    whatever the split (mid pooling group, mid candidate block)."""
    _, model = golden_model
    engine = Engine(model, golden_hasher, bounded_replay=False)
    prompt = golden_prompts[2]
    reference = _reference(model, golden_hasher, prompt)
    for split in (1, 150, 201):
        cache = engine.new_cache()
        engine.replay(cache, engine.prefill(cache, prompt[:split]))
        logits = engine.replay(cache, engine.prefill(cache, prompt[split:]))
        assert (logits - reference[-1]).abs().max() < 1e-4, split


def test_bounded_replay_is_exact_within_a_window_and_bounded_beyond(tiny):
    model, hasher = tiny
    exact_engine = Engine(model, hasher, bounded_replay=False)
    bounded_engine = Engine(model, hasher, bounded_replay=True)
    short = _tokens(30, 4)  # fits in the window (32): nothing to approximate
    assert torch.equal(_greedy(bounded_engine, short, 4)[1], _greedy(exact_engine, short, 4)[1])
    long = _tokens(200, 4)
    cache = bounded_engine.new_cache()
    inputs = bounded_engine.prefill(cache, long)
    assert inputs.positions.tolist() == list(range(200))
    bounded = bounded_engine.replay(cache, inputs)
    decoder = range(model.config.decoder_start, model.config.num_hidden_layers)
    assert all(cache.windows[i].start == 200 - 32 for i in decoder)  # replayed the last 32 only
    exact = _greedy(exact_engine, long, 0)[1][0]
    assert torch.isfinite(bounded).all() and (bounded - exact).abs().max() > 0


def test_batch_of_four_agrees_with_each_alone(golden_model, golden_hasher, golden_prompts):
    """Sequences that join and leave a batch get the logits they get alone. Not bit for
    bit: a batch's projections multiply [N, D] at once, another kernel order than
    [1, D] (on this AMD machine a 4-row Linear differs from four 1-row ones in the last
    bit), so to the golden tolerance, teacher-forced (both runs feed the same tokens)."""
    _, model = golden_model
    engine = Engine(model, golden_hasher, bounded_replay=True)
    prompts = [golden_prompts[0], golden_prompts[1], golden_prompts[2], golden_prompts[1][:97]]
    alone = [_greedy(engine, p, 9) for p in prompts]  # (tokens, logits [10, V])
    caches = [engine.new_cache() for _ in prompts]
    together = [[engine.replay(c, engine.prefill(c, p))] for c, p in zip(caches, prompts)]
    # Requests join and leave: the second joins late, the last leaves early.
    for step in range(9):
        active = [i for i in range(4) if not (i == 1 and step < 3) and not (i == 3 and step >= 6)]
        fed = [alone[i][0][len(together[i]) - 1] for i in active]
        for i, logits in zip(active, engine.decode([(caches[i], [t]) for i, t in zip(active, fed)])):
            together[i].append(logits[-1])
    assert [len(t) for t in together] == [10, 7, 10, 7]
    for (_, expected, _), got in zip(alone, together):
        assert (torch.stack(got) - expected[: len(got)]).abs().max() < 1e-4


def test_a_steps_engram_rows_are_each_sequences_own(tiny):
    """A step hashes every sequence's new tokens in one call over the right-padded
    batch; each sequence gets the row ids and the n-gram context it gets hashed alone,
    whatever the other sequences' lengths."""
    model, hasher = tiny
    engine = Engine(model, hasher)
    caches = [engine.new_cache() for _ in range(3)]
    for cache, n in zip(caches, (5, 1, 9)):
        engine.prefill(cache, _tokens(n, n))
    ids = [torch.tensor(_tokens(n, 10 + n)) for n in (3, 1, 2)]
    alone = [hasher.hash_ids(t[None], cache.ngram) for cache, t in zip(caches, ids)]
    together = engine.engram_ids.of_step(caches, ids)
    assert torch.equal(together, torch.cat([row_ids for row_ids, _ in alone], dim=1))
    for cache, (_, context) in zip(caches, alone):
        assert torch.equal(cache.ngram.tail, context.tail)


def test_restore_rebuilds_expired_windows(tiny):
    """Encoder SWA Bounded Replay: exact when the sequence fits in the window, and it
    only ever reads the last window of tokens."""
    model, hasher = tiny
    engine = Engine(model, hasher, bounded_replay=False)
    short = _tokens(30, 5)  # shorter than the window (32): the bounded replay is exact
    cache = engine.new_cache()
    engine.replay(cache, engine.prefill(cache, short))
    entries_before = {k: v.data.clone() for k, v in cache.entries.items()}
    for i in range(len(cache.windows)):
        cache.windows[i] = None
    cache.pending = {k: v[:0] for k, v in cache.pending.items()}
    restored = engine.restore(cache, short)
    follow = _tokens(9, 6)
    logits = engine.replay(cache, restored.then(engine.prefill(cache, follow)))
    # Held to the same engine with its windows kept, which multiplies in the same
    # order: the reference multiplies in another, and on random weights an FP4 or
    # selection flip there moves these logits by 0.5 on an Intel Xeon with AVX-512.
    kept = engine.new_cache()
    engine.replay(kept, engine.prefill(kept, short))
    assert (logits - engine.replay(kept, engine.prefill(kept, follow))).abs().max() < 1e-4
    for k, v in entries_before.items():  # long-range state was not rewritten
        assert torch.equal(cache.entries[k].data[: v.shape[0]], v)
    # A long conversation: only the last window is replayed.
    long = _tokens(120, 7)
    cache = engine.new_cache()
    engine.replay(cache, engine.prefill(cache, long))
    for i in range(len(cache.windows)):
        cache.windows[i] = None
    restored = engine.restore(cache, long)
    assert restored.positions.tolist() == list(range(120 - 32, 120))
    logits = engine.replay(cache, restored.then(engine.prefill(cache, follow)))
    assert torch.isfinite(logits).all()


def test_restore_of_more_windows_warms_up_and_one_per_layer_is_exact(tiny):
    """Encoder SWA Bounded Replay of M windows reruns the last M windows of tokens; the
    windows it rebuilds draw nearer the kept ones as M grows, and with one window per
    layer (``restore_windows=None``) they are the kept ones: to float rounding, as
    the rerun runs the same tokens in other groupings than the prefill did."""
    model, hasher = tiny
    window, layers = model.config.sliding_window, model.config.num_hidden_layers
    conversation, follow = _tokens(layers * window + 100, 8), _tokens(9, 6)
    kept_engine = Engine(model, hasher, bounded_replay=False)
    kept = kept_engine.new_cache()
    kept_engine.replay(kept, kept_engine.prefill(kept, conversation))
    expected = kept_engine.replay(kept, kept_engine.prefill(kept, follow))
    differences = {}
    for windows in (1, 4, None):
        engine = Engine(model, hasher, bounded_replay=False, restore_windows=windows)
        cache = engine.new_cache()
        engine.replay(cache, engine.prefill(cache, conversation))
        entries = {k: v.data.clone() for k, v in cache.entries.items()}
        cache.windows = [None] * len(cache.windows)
        cache.pending = {k: v[:0] for k, v in cache.pending.items()}
        restored = engine.restore(cache, conversation)
        rerun = layers * window if windows is None else windows * window
        assert restored.positions.tolist() == list(range(len(conversation) - rerun, len(conversation)))
        logits = engine.replay(cache, restored.then(engine.prefill(cache, follow)))
        differences[windows] = float((logits - expected).abs().max())
        for k, v in entries.items():  # long-range state was not rewritten
            assert torch.equal(cache.entries[k].data[: v.shape[0]], v)
    assert differences[None] < 1e-4
    # Random weights drift far from a cold window (2-3.5 in logits here); four windows of
    # this 12-layer model less, yet not exactly.
    assert differences[1] > 0.3 and 1e-4 < differences[4] < differences[1]
    with pytest.raises(ValueError, match="restore_windows"):
        Engine(model, hasher, restore_windows=0)


def test_chunked_prefill_equals_one_shot(golden_model, golden_hasher, golden_prompts):
    _, model = golden_model
    prompt = golden_prompts[2]
    results = []
    for chunk in (1024, 37, 8):
        engine = Engine(model, golden_hasher, bounded_replay=False, prefill_chunk=chunk, query_chunk=5)
        cache = engine.new_cache()
        results.append((engine.replay(cache, engine.prefill(cache, prompt)), cache))
    (one_shot, reference_cache), *chunked = results
    for logits, cache in chunked:
        assert (logits - one_shot).abs().max() < 1e-4
        for source, rows in cache.entries.items():
            assert torch.equal(rows.data, reference_cache.entries[source].data)


def test_encoder_only_model_prefills_identically(golden_dir, golden_hasher, golden_prompts):
    """What a prefill replica holds: same handoff, a fraction of the weights."""
    from model.loader import load_model

    _, full = load_model(golden_dir)
    _, encoder = load_model(golden_dir)
    encoder.keep_encoder_only()
    assert sum(p.numel() for p in encoder.parameters()) < 0.8 * sum(p.numel() for p in full.parameters())
    prompt = golden_prompts[1]
    caches, inputs = [], []
    for model in (full, encoder):
        engine = Engine(model, golden_hasher)
        cache = engine.new_cache()
        inputs.append(engine.prefill(cache, prompt))
        caches.append(cache)
    assert torch.equal(inputs[0].streams, inputs[1].streams)
    for source, rows in caches[0].entries.items():
        assert torch.equal(rows.data, caches[1].entries[source].data)


def _sequence_by_sequence(engine: Engine) -> Engine:
    """The same engine with every cache read per sequence (:meth:`CachedKeys._sequence_keys`)."""
    engine.BATCHED_TOKENS = 0
    return engine


@pytest.mark.parametrize("which", ["golden", "tiny"])
def test_batched_cache_reads_equal_per_sequence_reads(which, golden_model, golden_hasher, golden_prompts, tiny):
    """A step's window slices, long-range rows and indexer run once over the padded
    batch (decode and verify steps) and give what each sequence's own reads give:
    the same greedy tokens, logits to the golden tolerance, the same cache bytes. The
    prompts differ in length, so the batch is padded (different window starts, entry
    counts short of top-k and beyond it); verify steps, one with a different number of
    tokens per sequence, are taken back."""
    model, hasher = (golden_model[1], golden_hasher) if which == "golden" else tiny
    prompts = [golden_prompts[0], golden_prompts[1][:40], golden_prompts[2][:7], golden_prompts[1]]
    engines = [Engine(model, hasher), _sequence_by_sequence(Engine(model, hasher))]
    runs = []
    for engine in engines:
        caches = [engine.new_cache() for _ in prompts]
        logits = [[engine.replay(c, engine.prefill(c, p))] for c, p in zip(caches, prompts)]
        for step in range(6):
            fed = [[int(rows[-1].argmax())] for rows in logits]
            if step in (2, 4):  # verify the greedy token and up to two guesses each, keep some
                counts, kept = ([3, 1, 2, 3], [2, 1, 2, 3]) if step == 2 else ([2, 2, 2, 2], [1, 2, 2, 1])
                fed = [[t[0], (t[0] + 7) % 1000 + 3, (t[0] * 3) % 1000 + 3][:c] for t, c in zip(fed, counts)]
                out, rewinds = engine.verify(list(zip(caches, fed)))
                for cache, rewind, rows, step_logits, keep in zip(caches, rewinds, logits, out, kept):
                    engine.accept(cache, rewind, keep)
                    rows.extend(step_logits[:keep])
            else:
                for rows, step_logits in zip(logits, engine.decode(list(zip(caches, fed)))):
                    rows.append(step_logits[-1])
        runs.append((caches, [torch.stack(rows) for rows in logits]))
    (batched, batched_logits), (alone, alone_logits) = runs
    # The padded batch sums its attention and pools its groups in another order than
    # one sequence alone, so a cache value on an FP8/FP4 rounding boundary may round
    # the other way (on the golden checkpoint none does here; the tiny config's random
    # weights carry such a flip to ~6e-4 in the logits on an Intel Xeon, 0.115 on an
    # AMD EPYC). A window read one place off moves them by 0.23 (golden) and 4.8 (tiny).
    tolerance = 1e-4 if which == "golden" else 0.5
    for a, b in zip(batched_logits, alone_logits):
        assert a.shape == b.shape and (a - b).abs().max() < tolerance
        if which == "golden":
            assert torch.equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(batched, alone):
        assert a.length == b.length
        pairs = [(a.entries[s], b.entries[s]) for s in a.entries] + [(a.keys[s], b.keys[s]) for s in a.keys]
        pairs += [(wa.rows, wb.rows) for wa, wb in zip(a.windows, b.windows) if wa.start == wb.start]
        assert [w.start for w in a.windows] == [w.start for w in b.windows]
        for rows_a, rows_b in pairs:  # (a flip carries on to later rows: on an AMD EPYC 5 of tiny's 32)
            _agree_but_for_rounding_flips(rows_a.values, rows_b.values, 0.15 if which == "golden" else 1.0)
        for source in a.pending:
            assert a.pending[source].shape == b.pending[source].shape
            assert torch.allclose(a.pending[source], b.pending[source], atol=tolerance, rtol=0)


def _agree_but_for_rounding_flips(a: torch.Tensor, b: torch.Tensor, share: float = 0.15) -> None:
    """Cache rows equal but for fewer than ``share`` of the rows, off by at most two
    codes at the row's scale."""
    assert a.shape == b.shape
    if not a.numel():
        return
    assert ((a - b).abs().amax(-1) > 0).float().mean() < share
    assert ((a - b).abs() <= b.abs().amax(-1, keepdim=True) / 6 * 2).all()


def test_a_decode_steps_groups_are_made_as_any_steps_are(tiny, monkeypatch):
    """A decode step pools its completed groups (:func:`long_range._one_token_groups`:
    a few operations for the whole batch) into the same bytes, pending rows and logits
    as the general form that every other step uses, bit for bit: prompts of three
    lengths, so that on every step some sequences complete a group of 2 and some do
    not, beside the layers of ratio 1, one sequence alone and the three together."""
    from model.runtime import long_range

    model, hasher = tiny
    prompts = [_tokens(n, n) for n in (41, 50, 63)]
    calls = {"one token": 0}
    one_token_groups = long_range._one_token_groups

    def counted(*args):
        calls["one token"] += 1
        return one_token_groups(*args)

    runs = []
    for general in (False, True):
        if general:
            monkeypatch.setattr(long_range, "_one_token_each", lambda *args: False)
        else:
            monkeypatch.setattr(long_range, "_one_token_groups", counted)
        engine = Engine(model, hasher)
        caches = [engine.new_cache() for _ in prompts]
        logits = [[engine.replay(c, engine.prefill(c, p))] for c, p in zip(caches, prompts)]
        for step in range(5):
            batch = [0] if step == 1 else range(3)  # one step of one sequence: the others wait
            out = engine.decode([(caches[i], [int(logits[i][-1].argmax())]) for i in batch])
            for i, step_logits in zip(batch, out):
                logits[i].append(step_logits[-1])
        runs.append((caches, [torch.stack(rows) for rows in logits]))
    sources = sum(plan.is_kv_source for plan in model.config.layer_plans())
    assert sources >= 3 and calls["one token"] == 5 * sources  # every decode step, at each KV source
    (fast, fast_logits), (general, general_logits) = runs
    assert all(torch.equal(a, b) for a, b in zip(fast_logits, general_logits))
    for a, b in zip(fast, general):
        for source in a.entries:
            assert torch.equal(a.entries[source].data, b.entries[source].data)
            assert torch.equal(a.keys[source].data, b.keys[source].data)
            assert torch.equal(a.pending[source], b.pending[source])
