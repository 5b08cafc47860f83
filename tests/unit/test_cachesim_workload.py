"""The retention lab's workloads: the shipped Mooncake traces read as chunk runs, stretched
and tiled; synthetic sessions seeded, time-ordered, sharing exactly the prefixes their
story says they share."""

from __future__ import annotations

import gc
import gzip
import hashlib
import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from cluster.lab.sessions import _Session, synthetic
from cluster.lab.workload import CHUNK_TOKENS, CONVERSATION_TRACE, SYNTHETIC_TRACE, Profile, mooncake

pytestmark = pytest.mark.unit


def _rows(path):
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]


def test_the_shipped_traces_read_as_chunk_runs():
    rows = _rows(CONVERSATION_TRACE)
    requests = list(mooncake(CONVERSATION_TRACE))
    assert len(requests) == len(rows) == 12031 and len(list(mooncake(SYNTHETIC_TRACE))) == 3993
    for row, request in zip(rows[:500], requests):
        assert request.time_s == row["timestamp"] / 1000 and request.input_tokens == row["input_length"]
        assert request.chunks == row["input_length"] // CHUNK_TOKENS  # the full chunks of the prompt
        assert [owner for owner, _, _ in request.runs] == row["hash_ids"][: len(request.runs)]
    # Requests that share leading hash ids share those chunks, and only those.
    a, b = requests[0], requests[1]
    assert rows[0]["hash_ids"][0] == rows[1]["hash_ids"][0] and rows[0]["hash_ids"][1] != rows[1]["hash_ids"][1]
    assert a.chunk_ids()[:4] == b.chunk_ids()[:4] and a.chunk_ids()[4] != b.chunk_ids()[4]


def test_stretch_scales_time_and_tile_chains_fresh_copies_keeping_shared_roots():
    once = list(mooncake(SYNTHETIC_TRACE))
    stretched = list(mooncake(SYNTHETIC_TRACE, stretch=72))
    assert [r.time_s for r in stretched] == pytest.approx([72 * r.time_s for r in once])
    tiled = list(mooncake(SYNTHETIC_TRACE, tile=3))
    assert len(tiled) == 3 * len(once)
    assert all(x.time_s <= y.time_s for x, y in itertools.pairwise(tiled))
    first, second = tiled[: len(once)], tiled[len(once) : 2 * len(once)]
    firsts = Counter(r.runs[0][0] for r in once if r.runs)
    for a, b in zip(first, second):
        assert a.input_tokens == b.input_tokens and a.chunks == b.chunks
        if a.runs:
            shared_root = firsts[a.runs[0][0]] > 1
            assert (a.runs[0] == b.runs[0]) == shared_root
            assert all(x != y for x, y in zip(a.runs[1:], b.runs[1:]))  # fresh ids past the root


def test_synthetic_sessions_are_seeded_time_ordered_and_grow_their_prefix():
    profile = Profile.named("agent", sessions=150, hours=6, seed=3)
    requests = list(synthetic(profile))
    assert requests == list(synthetic(profile))
    assert requests != list(synthetic(profile.model_copy(update={"seed": 4})))
    assert all(x.time_s <= y.time_s for x, y in itertools.pairwise(requests))
    assert len({r.session for r in requests}) == 150
    by_session: dict[int, list] = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)
    grew = forked = 0
    for turns in by_session.values():
        for earlier, later in itertools.pairwise(turns):
            ids, next_ids = earlier.chunk_ids(), later.chunk_ids()
            shared = next(k for k in range(len(ids) + 1) if k == len(ids) or k == len(next_ids)
                          or ids[k] != next_ids[k])
            if later.resume == earlier.window:
                grew += 1  # the next prompt holds this one, its answer and a new message
                assert shared == len(ids) and later.input_tokens > earlier.window[1]
                # ... with the chunks the answer completed.
                completed = [(o, i) for o, a, b in earlier.after for i in range(a, b)]
                assert next_ids[len(ids) : len(ids) + len(completed)] == completed
            else:
                # A fork: it continues an earlier turn's end, on a new branch from there on.
                forked += 1
                assert later.resume[1] < later.input_tokens
        # A chunk id stands for the whole prefix up to it: two turns that share chunk i
        # share every chunk before it.
        chains = [turn.chunk_ids() for turn in turns]
        for a in chains:
            for b in chains:
                common = [i for i in range(min(len(a), len(b))) if a[i] == b[i]]
                assert common == list(range(len(common)))
    assert grew > 10 * forked > 0  # forks: 5% of agent turns


def _stream_digest(profile: Profile) -> str:
    h = hashlib.sha256()
    for r in synthetic(profile):  # times to the millisecond: a last-bit difference of exp() is not a change
        h.update(repr((round(r.time_s, 3), r.session, r.input_tokens, r.output_tokens, r.runs, r.after, r.window,
                       r.resume)).encode())
    return h.hexdigest()


def test_a_seed_gives_the_same_stream_in_every_version():
    # The published results (docs/retention.md) came from these streams: a change to the
    # generator that changes them must say so, and measure again.
    assert _stream_digest(Profile.named("agent", sessions=300, hours=6)) == \
        "95105b78df9afb0ab478b0d493ce8309ddc1c87e969c892b8e6e771fc9612234"
    assert _stream_digest(Profile.named("mixed", sessions=300, hours=6, seed=5)) == \
        "730baef3844e88f4d0589ce54bee86604eb2dab4c09f79a9d74db58e96d0780c"


def test_a_session_is_held_only_while_it_runs():
    # A million sessions' histories held to the end were gigabytes per simulator process.
    stream = synthetic(Profile.named("agent", sessions=2000, hours=48))
    first = list(itertools.islice(stream, 20000))
    started = len({r.session for r in first})
    live = sum(isinstance(o, _Session) for o in gc.get_objects())
    assert started > 500 and live < started / 3  # 177 of 845 here; every one of 2000 was held before


def test_the_agenda_gives_the_earliest_turn_and_equal_times_in_session_order():
    from cluster.lab.sessions import _Agenda

    sessions = [_Session(i, 1, 0, 0, [], 0, []) for i in range(5)]
    agenda = _Agenda()
    for time_s, index in ((5.0, 2), (5.0, 4), (3.0, 3), (5.0, 0), (9.0, 1)):
        agenda.push(time_s, sessions[index])
    popped = []
    while agenda:
        time_s, session = agenda.pop()
        popped.append((time_s, session.index))
        if popped == [(3.0, 3), (5.0, 0)]:
            agenda.push(5.0, sessions[0])  # due again at once: before the others due then (lower index)
    assert popped == [(3.0, 3), (5.0, 0), (5.0, 0), (5.0, 2), (5.0, 4), (9.0, 1)]


def test_sessions_with_the_same_system_prompt_share_its_chunks():
    requests = list(synthetic(Profile.named("chat", sessions=400, hours=2, system_prompts=3, seed=1)))
    first_turns = {}
    for r in requests:
        first_turns.setdefault(r.session, r)
    owners = Counter(r.runs[0][0] for r in first_turns.values() if r.runs and r.runs[0][1] == 0)
    assert len(owners) <= 3 + sum(1 for r in first_turns.values() if r.runs and r.runs[0][1] != 0)
    assert max(owners.values()) > 100  # Zipf: the first prompt is shared by many sessions


def test_profiles_are_one_file_of_checked_parameters(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("profile: agent\nsessions: 5\ntool_share: 0.25\nturns: {median: 3, sigma: 0.1}\n")
    profile = Profile.from_file(path)
    assert (profile.sessions, profile.tool_share, profile.turns.median) == (5, 0.25, 3)
    assert profile.message_tokens == Profile.named("agent").message_tokens  # the rest from the profile
    path.write_text("sessions: 5\ntool_shares: 0.25\n")
    with pytest.raises(ValueError, match="tool_shares"):
        Profile.from_file(path)
    with pytest.raises(ValueError, match="unknown profile"):
        Profile.named("batch")


def test_object_sizes_come_from_the_models_own_serialisation():
    from cluster.lab.sizes import from_config, v4_flash
    from model.accounting import kv_bytes_per_token
    from model.config import ModelConfig
    from model.formats import WINDOW_KV
    from model.runtime.serialize import HEADER_BYTES as LAYOUT_HEADER
    from storage.codec import HEADER_BYTES as ENVELOPE

    v41 = from_config()
    text = ModelConfig.from_dict(json.loads((Path(__file__).parents[2] / "configs" / "deepseek-v4.1-flash" /
                                             "config.json").read_text())).text
    assert kv_bytes_per_token(text) == 890
    assert v41.chunk_bytes == 890 * 128 + LAYOUT_HEADER + ENVELOPE
    window_rows = text.num_hidden_layers * text.sliding_window * WINDOW_KV.for_width(512).nbytes(512)
    assert window_rows < v41.window_bytes < window_rows + 64 * 890 + 3 * 4 * text.hidden_size * 4 + 4096
    v4 = v4_flash()
    assert v4.persist_windows and not v41.persist_windows
    assert v4.chunk_bytes_per_token / v41.chunk_bytes_per_token == pytest.approx(4.0, rel=0.01)
