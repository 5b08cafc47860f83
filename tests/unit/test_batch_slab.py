"""The caches of a batch kept side by side (model.runtime.batch_slab) against each
sequence's rows in buffers of their own: the same logits and the same cache bytes, bit
for bit, while sequences join, leave, outnumber the rows, outgrow the long-range
buffers and verify."""

from __future__ import annotations

import pytest
import torch

from model.formats import WINDOW_KV
from model.runtime.cache import PackedRows, Window
from model.runtime.engine import Engine
from model.runtime.batch_slab import BatchSlab

pytestmark = pytest.mark.unit


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[torch.Tensor]], list]:
    """Greedy steps over a batch whose members change: the first two step alone, the
    third joins (the rows grow), the second leaves and comes back, one step verifies
    three tokens each and keeps some."""
    caches = [engine.new_cache() for _ in prompts]
    logits = [[engine.replay(c, engine.prefill(c, p))] for c, p in zip(caches, prompts)]
    plan = [[0, 1], [0, 1], [0, 1, 2], [0, 2], [0, 2, 3], [0, 1, 2, 3], "verify", [3, 1], [0, 1, 2, 3]]
    for members in plan:
        if members == "verify":
            fed = [[int(rows[-1].argmax()), 5, 9] for rows in logits]
            out, rewinds = engine.verify(list(zip(caches, fed)))
            for cache, rewind, rows, step, keep in zip(caches, rewinds, logits, out, [3, 1, 2, 1]):
                engine.accept(cache, rewind, keep)
                rows.extend(step[:keep])
            continue
        step = engine.decode([(caches[i], [int(logits[i][-1].argmax())]) for i in members])
        for i, out in zip(members, step):
            logits[i].append(out[-1])
    return logits, caches


def _assert_same_caches(got_caches, expected_caches) -> None:
    for a, b in zip(got_caches, expected_caches):
        for wa, wb in zip(a.windows, b.windows):
            assert (wa.start, wa.rows.n) == (wb.start, wb.rows.n)
            assert torch.equal(wa.rows.data, wb.rows.data) and torch.equal(wa.rows.values, wb.rows.values)
        for ra, rb in [(a.entries[s], b.entries[s]) for s in a.entries] + [(a.keys[s], b.keys[s]) for s in a.keys]:
            assert ra.n == rb.n > 0
            assert torch.equal(ra.data, rb.data) and torch.equal(ra.values, rb.values)


def test_a_batch_in_the_slab_computes_what_separate_caches_compute(golden_model, golden_hasher, golden_prompts):
    _, model = golden_model
    prompts = [golden_prompts[0], golden_prompts[1][:40], golden_prompts[2], golden_prompts[1]]
    slab, separate = Engine(model, golden_hasher), Engine(model, golden_hasher)
    separate.slab = None
    (got, got_caches), (expected, expected_caches) = _run(slab, prompts), _run(separate, prompts)
    assert [len(rows) for rows in got] == [11, 8, 8, 6]
    for a, b in zip(got, expected):
        assert torch.equal(torch.stack(a), torch.stack(b))
    _assert_same_caches(got_caches, expected_caches)
    # The last step held all four; the second left it before and came back: all seated,
    # long-range rows too.
    assert sorted(slab.slab.admit([c for c in got_caches])) == [0, 1, 2, 3]
    source = next(iter(got_caches[0].entries))
    table = slab.slab.table(("entries", source))
    for cache in got_caches:
        assert cache.entries[source].values.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()


def test_long_range_rows_outgrowing_their_buffer_move_with_it(golden_model, golden_hasher, golden_prompts):
    """Buffers made for the shortest prompts grow as the long ones join (every seated
    sequence's rows copied along), a slab too small for any long-range buffer pads the
    rows, and one with room for some pads the rest: all compute what separate caches
    compute."""
    _, model = golden_model
    prompts = [golden_prompts[1][:20], golden_prompts[1][:24], golden_prompts[0], golden_prompts[2]]
    grown, unseated, separate = (Engine(model, golden_hasher) for _ in range(3))
    unseated.slab.max_bytes = 0
    separate.slab = None
    source = min(plan.index for plan in model.config.layer_plans() if plan.is_kv_source)
    capacities = []
    real_room = grown.slab._room

    def room(place, rows):  # (records each long-range buffer the steps make)
        buffer = real_room(place, rows)
        if place == ("entries", source) and buffer is not None and buffer.capacity not in capacities:
            capacities.append(buffer.capacity)
        return buffer

    grown.slab._room = room
    (got, got_caches), (padded, padded_caches), (expected, expected_caches) = (
        _run(engine, prompts) for engine in (grown, unseated, separate))
    assert len(capacities) >= 2 and capacities == sorted(capacities), capacities
    assert not unseated.slab._buffers.get(("entries", source))
    for a, b, c in zip(got, padded, expected):
        assert torch.equal(torch.stack(a), torch.stack(c)) and torch.equal(torch.stack(b), torch.stack(c))
    _assert_same_caches(got_caches, expected_caches)
    _assert_same_caches(padded_caches, expected_caches)

    # A budget of half what the long-range buffers took: some places are padded instead,
    # the buffers kept stay within it, and the step computes the same.
    kept = _long_range_bytes(grown.slab)
    tight = Engine(model, golden_hasher)
    tight.slab.max_bytes = kept // 2
    got_tight, tight_caches = _run(tight, prompts)
    assert 0 < _long_range_bytes(tight.slab) <= kept // 2
    for a, c in zip(got_tight, expected):
        assert torch.equal(torch.stack(a), torch.stack(c))
    _assert_same_caches(tight_caches, expected_caches)


def _long_range_bytes(slab: BatchSlab) -> int:
    return sum(buffer.nbytes for place, buffer in slab._buffers.items() if place[0] != "window")


def test_a_sequence_leaving_keeps_its_windows_in_a_buffer_of_its_own(golden_model, golden_hasher, golden_prompts):
    _, model = golden_model
    engine = Engine(model, golden_hasher)
    caches = [engine.new_cache() for _ in range(3)]
    firsts = [int(engine.replay(c, engine.prefill(c, p)).argmax()) for c, p in zip(caches, golden_prompts)]
    engine.decode([(c, [t]) for c, t in zip(caches, firsts)])
    leaving = caches[1].windows[-1].rows
    kept = leaving.data.clone(), leaving.values.clone()
    engine.decode([(caches[0], [3]), (caches[2], [4])])  # the second leaves: its row is given back
    assert torch.equal(leaving.data, kept[0]) and torch.equal(leaving.values, kept[1])
    slab_values = engine.slab.table(("window", len(caches[1].windows) - 1))
    storage = slab_values.untyped_storage().data_ptr()
    assert leaving.values.untyped_storage().data_ptr() != storage
    assert caches[0].windows[-1].rows.values.untyped_storage().data_ptr() == storage
    assert engine.slab.occupants.count(None) == 1


def test_a_window_too_long_for_a_row_is_not_seated():
    slab = BatchSlab(window=2, step_tokens=1)  # rows of 8 places: windows of up to 4
    windows = [Window(PackedRows(WINDOW_KV, 32)), Window(PackedRows(WINDOW_KV, 32))]
    windows[0].rows.append(torch.randn(3, 32))
    windows[1].rows.append(torch.randn(5, 32))
    rows = slab.admit([object(), object()])
    assert not slab.seat(("window", 0), [w.rows for w in windows], rows)
    windows[1].rows.truncate(4)
    before = [w.rows.values.clone() for w in windows]
    assert slab.seat(("window", 0), [w.rows for w in windows], rows)
    got = slab.read_windows(0, windows, rows, [0, 1], [3, 3], torch.arange(3))
    assert torch.equal(got[0], before[0]) and torch.equal(got[1], before[1][1:4])


def test_windows_in_lockstep_are_written_and_read_once_a_step(golden_model, golden_hasher, golden_prompts,
                                                             monkeypatch):
    """A batch's windows slide together, so a step writes and reads every layer's with
    the same index tensors (BatchSlab.lockstep): bit for bit what separate caches
    compute over 90 steps, through a window seated again (released at step 40) and
    rows that reach the end of theirs (step 80, window 16 in rows of 96), both moved
    to the front of their rows without leaving the lockstep."""
    _, model = golden_model
    steps = []
    lockstep = BatchSlab.lockstep
    monkeypatch.setattr(BatchSlab, "lockstep", lambda self, *args: steps.append(lockstep(self, *args)) or steps[-1])

    def run(engine: Engine):
        caches = [engine.new_cache() for _ in range(2)]
        tokens = [[int(engine.replay(c, engine.prefill(c, p)).argmax())] for c, p in zip(caches, golden_prompts[:2])]
        logits = []
        for step in range(90):
            if step == 40:
                caches[1].windows[3].rows.release()  # (its rows to a buffer of their own)
            out = engine.decode([(c, [t[-1]]) for c, t in zip(caches, tokens)])
            for t, rows in zip(tokens, out):
                t.append(int(rows[-1].argmax()))
            logits.append(torch.stack([rows[-1] for rows in out]))
        return torch.stack(logits), caches

    slab, separate = Engine(model, golden_hasher), Engine(model, golden_hasher)
    separate.slab = None
    (got, got_caches), (expected, expected_caches) = run(slab), run(separate)
    assert slab.slab.window_capacity == 96 and model.config.sliding_window == 16
    assert torch.equal(got, expected)
    _assert_same_caches(got_caches, expected_caches)
    assert len(steps) == 90 and [i for i, step in enumerate(steps) if step is None] == [0, 40]
    # The step's indices: one new row per sequence, in its row of the slab, at each layer alike.
    first_row = [step.append.tolist() for step in steps[1:3]]
    assert first_row[1] == [row + 1 for row in first_row[0]]
    assert all(step.trims == [1, 1] and step.lengths == [16, 16] for step in steps if step is not None)
    for cache in got_caches:
        assert len({(w.start, w.rows.n, w.rows.offset) for w in cache.windows}) == 1
