"""The retention lab's simulator: the real store's policy decides, on a virtual clock.

Hand-made sessions whose outcome follows from the policy alone (window TTL, chunk
retention, RAM capacity, V4's persisted windows), and the two modes (real files, sizes
only) giving identical counters on the same trace slice."""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from cluster.lab.sim_config import SimConfig
from cluster.lab.simulate import simulate
from cluster.lab.sizes import Sizes
from cluster.lab.workload import CHUNK_TOKENS, CONVERSATION_TRACE, Request, mooncake
from storage.codec import HEADER_BYTES

pytestmark = pytest.mark.unit

SIZES = Sizes("test", CHUNK_TOKENS, chunk_bytes=1000, window_bytes=5000, persist_windows=False, source="test")
V4 = Sizes("test-v4", CHUNK_TOKENS, chunk_bytes=4000, window_bytes=5000, persist_windows=True, source="test")
OWNER = 7


def _turns(*times_s: float, first: int = 610, answer: int = 100, message: int = 200):
    """One session's turns at these times: each prompt holds the last, its answer and a message."""
    requests, prompt, resume = [], first, None
    for time_s in times_s:
        end = prompt + answer
        requests.append(Request(time_s, ((OWNER, 0, prompt // CHUNK_TOKENS),), prompt, answer, 0,
                                ((OWNER, prompt // CHUNK_TOKENS, end // CHUNK_TOKENS),), (OWNER, end), resume))
        resume, prompt = (OWNER, end), end + message
    return requests


def _run(requests, sizes=SIZES, **overrides):
    config = SimConfig(sizes, **{"ram_bytes": 10**9, "decode_tokens_per_s": 1e9, "prefill_tokens_per_s": 1e9,
                                 **overrides})
    return simulate(config, requests)


def test_the_next_turn_within_the_window_ttl_resumes_exactly():
    result = _run(_turns(0.0, 60.0))
    totals = result.totals
    # Turn 2's prompt: turn 1's 610 tokens + 100 answered + 200 new = 910; its chunks up
    # to 710 tokens (5 of 128) were stored, and the window state after 710.
    assert totals.hit_tokens_ram == 5 * CHUNK_TOKENS and totals.hit_tokens_ssd == 0
    assert (totals.window_candidates, totals.window_hits_ram, totals.replays) == (1, 1, 0)
    assert totals.prefill_tokens == 610 + (910 - 710)


def test_past_the_window_ttl_the_chunks_hit_and_the_encoder_replays():
    totals = _run(_turns(0.0, 31 * 60.0), window_ttl_minutes=30.0).totals
    assert totals.hit_tokens_ram == 5 * CHUNK_TOKENS
    assert (totals.window_hits_ram, totals.replays) == (0, 1)
    assert totals.prefill_tokens == 610 + (910 - 5 * CHUNK_TOKENS)


def test_a_full_ram_sends_reads_to_ssd_and_retention_ends_everything():
    # RAM holds one window state only: chunks are read from SSD.
    totals = _run(_turns(0.0, 60.0, 3 * 3600.0), ram_bytes=5000).totals
    assert totals.hit_tokens_ram == 0 and totals.hit_tokens_ssd == (5 + 7) * CHUNK_TOKENS
    late = _run(_turns(0.0, 73 * 3600.0)).totals
    assert late.hit_tokens_ram + late.hit_tokens_ssd == 0 and late.window_hits_ram == 0


def test_v4_persists_window_states_so_a_late_turn_resumes_from_ssd():
    assert _run(_turns(0.0, 2 * 3600.0), sizes=V4).totals.window_hits_ssd == 1
    assert _run(_turns(0.0, 2 * 3600.0), sizes=SIZES).totals.window_hits_ssd == 0


def test_a_shorter_retention_loses_what_a_longer_one_keeps():
    turns = _turns(0.0, 5 * 3600.0)
    assert _run(turns, chunk_retention_hours=4.0).totals.hit_tokens_ram == 0
    assert _run(turns, chunk_retention_hours=6.0).totals.hit_tokens_ram == 5 * CHUNK_TOKENS


@pytest.mark.parametrize("persist", [False, True])
def test_exact_and_scale_modes_give_identical_counters(persist):
    sizes = Sizes("t", CHUNK_TOKENS, 114_040, 2_791_200, persist, "test")
    requests = list(itertools.islice(mooncake(CONVERSATION_TRACE, stretch=40), 400))
    results = [_run(requests, sizes=sizes, mode=mode, shrink=1000, ram_bytes=1 << 30, ssd_bytes=4 << 30,
                    chunk_retention_hours=2.0, window_ttl_minutes=20.0, hours=6.0)
               for mode in ("exact", "scale")]
    exact, scale = results
    assert exact.totals == scale.totals and exact.store == scale.store
    assert [(s.objects, s.bytes) for s in exact.samples] == [(s.objects, s.bytes) for s in scale.samples]
    # Every policy path was taken: RAM and SSD hits, evictions, expirations.
    tiers = exact.store["tiers"]
    assert exact.totals.hit_tokens_ram and exact.totals.hit_tokens_ssd
    assert tiers["ram"]["evictions"] and tiers["ssd"]["evictions"] and tiers["ssd"]["expirations"]


@pytest.mark.e2e
def test_the_command_compares_the_policies_on_a_trace():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "cluster.cli", "cache-sim", "run", "--trace", "synthetic",
                          "--stretch", "10", "--ram-gb", "50", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    v41, v4 = report["policies"]["v41"], report["policies"]["v4"]
    assert report["requests"] == v41["totals"]["requests"] == 3993
    # Unbounded SSD and 72 h: every chunk either policy stored is still there, so the
    # chunk hit rates agree; V4's persisted windows push chunks out of RAM to SSD.
    assert v41["rates"]["hit_rate"] == pytest.approx(v4["rates"]["hit_rate"])
    assert v4["rates"]["hit_rate_ssd"] > v41["rates"]["hit_rate_ssd"]
    assert 0 < report["stored_bytes_v41_over_v4"] < 1
    assert v41["sizes"]["chunk_bytes"] == 890 * 128 + HEADER_BYTES + 32 and not v41["sizes"]["persist_windows"]
    bad = subprocess.run([sys.executable, "-m", "cluster.cli", "cache-sim", "run", "--policies", "v5"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--policies" in bad.stderr


def test_a_policy_process_that_fails_raises_its_error_in_the_caller(tmp_path):
    """`cache-sim run`'s processes exit without tearing down: a failure must still reach
    the command, as the error it was."""
    from cluster.lab.policy_processes import in_policy_processes

    with pytest.raises(FileNotFoundError, match="config.json"):
        in_policy_processes([("v41", {"model": str(tmp_path / "absent"), "hours": 1.0}, ("synthetic", {}),
                              False, None, None)])


def test_a_restart_loses_ram_and_the_ssd_serves_the_next_turn():
    requests = _turns(0.0, 60.0, 120.0)
    kept = _run(requests, mode="exact").totals
    assert kept.hit_tokens_ssd == 0
    config = SimConfig(SIZES, ram_bytes=10**9, decode_tokens_per_s=1e9, prefill_tokens_per_s=1e9, mode="exact")
    restarted = simulate(config, requests, restarts=[90.0]).totals
    # Turn 3 (at 120 s) reads turn 2's 7 chunks: after the restart at 90 s, from SSD;
    # the window state (RAM only) is gone: the encoder replays.
    assert restarted.hit_tokens_ram == kept.hit_tokens_ram - 7 * CHUNK_TOKENS
    assert restarted.hit_tokens_ssd == 7 * CHUNK_TOKENS
    assert (restarted.window_hits_ram, restarted.replays) == (kept.window_hits_ram - 1, kept.replays + 1)
    with pytest.raises(ValueError, match="exact mode"):
        simulate(SimConfig(SIZES), requests, restarts=[90.0])


def test_a_measured_turn_end_decides_when_its_chunks_are_stored():
    first, second = _turns(0.0, 60.0)
    # The first turn ended (as measured) after the second arrived: nothing to hit yet.
    late = _run([first._replace(done_s=61.0), second]).totals
    assert late.hit_tokens_ram == 0 and late.window_hits_ram == 0
    early = _run([first._replace(done_s=59.0), second]).totals
    assert early.hit_tokens_ram == 5 * CHUNK_TOKENS and early.window_hits_ram == 1


def test_a_killed_run_resumes_from_its_checkpoint_to_the_same_counters(tmp_path):
    from cluster.lab.simulate import Simulator
    from cluster.lab.sessions import synthetic
    from cluster.lab.workload import Profile

    profile = Profile.named("agent", sessions=60, hours=12)
    config = SimConfig(SIZES, ram_bytes=400_000, ssd_bytes=3_000_000, chunk_retention_hours=3.0, hours=12)
    whole = simulate(config, synthetic(profile))
    checkpoint = tmp_path / "sim.npz"

    class Killed(Exception):
        pass

    def kill_at_hour_6(now_s, _requests):
        if now_s >= 6 * 3600:
            raise Killed

    with pytest.raises(Killed), Simulator(config) as simulator:
        simulator.run(synthetic(profile), kill_at_hour_6, checkpoint=checkpoint, checkpoint_every_s=0.0)
    with np.load(checkpoint) as saved:  # the first run's last save, short of the end
        taken = json.loads(str(saved["meta"]))["consumed"]
    assert 0 < taken < whole.totals.requests
    with Simulator(config) as simulator:
        resumed = simulator.run(synthetic(profile), checkpoint=checkpoint)
    assert resumed.totals == whole.totals and resumed.store == whole.store
    assert [(s.time_s, s.objects, s.bytes) for s in resumed.samples] == \
        [(s.time_s, s.objects, s.bytes) for s in whole.samples]
    # Every path was taken before the kill: evictions from both tiers, expirations.
    assert whole.store["tiers"]["ram"]["evictions"] and whole.store["tiers"]["ssd"]["evictions"]
    assert not checkpoint.exists()  # a finished run removes it
    with Simulator(config) as simulator, Simulator(SimConfig(SIZES, hours=12)) as other:
        simulator.save(checkpoint)
        with pytest.raises(ValueError, match="other settings"):
            other.load(checkpoint)


def test_checkpoints_of_a_big_state_take_a_bounded_share_of_the_run(tmp_path, monkeypatch):
    """A save that takes as long as the interval must not follow every request (the
    million-session run spent 90% of its V4 policy's time saving): on a clock where a
    save costs 2 s and a request ~0.1 s, saves take at most CHECKPOINT_SHARE of the run."""
    from cluster.lab import simulate as module
    from cluster.lab.sessions import synthetic
    from cluster.lab.workload import Profile

    now = [0.0]
    save_s = 2.0  # what a save costs on this clock

    def clock() -> float:
        now[0] += 0.05
        return now[0]

    saves = []
    real_save = module.Simulator.save

    def slow_save(self, path):
        saves.append(now[0])
        now[0] += save_s
        real_save(self, path)

    monkeypatch.setattr(module.time, "perf_counter", clock)
    monkeypatch.setattr(module.Simulator, "save", slow_save)
    profile = Profile.named("agent", sessions=400, hours=24)
    config = SimConfig(SIZES, ram_bytes=4_000_000, hours=24)
    with module.Simulator(config) as simulator:
        result = simulator.run(synthetic(profile), checkpoint=tmp_path / "sim.npz", checkpoint_every_s=1.0)
    run_s = now[0]
    assert result.totals.requests > 5000 and run_s > save_s * len(saves)
    assert 2 <= len(saves) and save_s * len(saves) <= module.CHECKPOINT_SHARE * run_s + save_s
    assert min(b - a for a, b in itertools.pairwise(saves)) >= save_s / module.CHECKPOINT_SHARE - 1e-6


def test_a_checkpoint_streams_the_stored_objects(tmp_path, monkeypatch):
    """A save holds no copy of the state: the million-session V4 run has tens of millions
    of objects, and a copy of them (~200 B each) was gigabytes on top of the state."""
    import tracemalloc

    from cluster.lab import checkpoints
    from cluster.lab import simulate as module
    from cluster.lab.sessions import synthetic
    from cluster.lab.workload import Profile

    monkeypatch.setattr(checkpoints, "ROWS_PER_WRITE", 1000)
    persisted = Sizes("test", CHUNK_TOKENS, chunk_bytes=1000, window_bytes=5000, persist_windows=True, source="test")
    config = SimConfig(persisted, ram_bytes=4_000_000, hours=24)
    with module.Simulator(config) as simulator:
        simulator.run(synthetic(Profile.named("agent", sessions=1500, hours=24)))
        objects = sum(simulator.store.stats().objects.values())
        tracemalloc.start()
        try:
            simulator.save(tmp_path / "sim.npz")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        with np.load(tmp_path / "sim.npz") as saved:
            assert len(saved["ram"]) + len(saved["ssd"]) == objects > 30_000
    assert peak < 40 * objects  # ~8 B per object here: the batch, the JSON of the rest


def test_the_requests_table_adds_up_to_the_totals(tmp_path):
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from cluster.lab.request_table import RequestTable
    from cluster.lab.sessions import synthetic
    from cluster.lab.workload import Profile

    table = RequestTable(tmp_path / "requests.parquet", rows_per_group=500)  # several row groups
    config = SimConfig(SIZES, ram_bytes=400_000, chunk_retention_hours=3.0, hours=12)
    totals = simulate(config, synthetic(Profile.named("agent", sessions=60, hours=12)), table=table).totals
    table.close()
    rows = pq.read_table(tmp_path / "requests.parquet")
    assert rows.num_rows == totals.requests > 500
    for column, total in (("input_tokens", totals.input_tokens), ("hit_tokens_ram", totals.hit_tokens_ram),
                          ("hit_tokens_ssd", totals.hit_tokens_ssd), ("prefill_tokens", totals.prefill_tokens),
                          ("replay", totals.replays), ("window_hit", totals.window_hits_ram + totals.window_hits_ssd)):
        assert pc.sum(rows[column].cast("int64")).as_py() == total, column
    times = rows["time_s"].to_pylist()
    assert times == sorted(times)


@pytest.mark.parametrize("workload", ["agent", "trace"])
def test_the_loop_leaves_nothing_for_the_cyclic_collector(workload, tmp_path):
    """The simulator runs with the cyclic GC off and collects nothing itself
    (``collector_paused``): sound only while its loop makes no reference cycles. Every
    path runs here: RAM evictions, SSD hits and expiry, GC, checkpoints, the table."""
    import gc

    from cluster.lab.request_table import RequestTable
    from cluster.lab.simulate import Simulator
    from cluster.lab.sessions import synthetic
    from cluster.lab.workload import Profile

    if workload == "agent":
        requests = synthetic(Profile.named("agent", sessions=200, hours=6))
    else:
        requests = itertools.islice(mooncake(CONVERSATION_TRACE, stretch=40), 1500)
    simulator = Simulator(SimConfig(V4, ram_bytes=2_000_000, chunk_retention_hours=2.0, hours=6))
    table = RequestTable(tmp_path / "requests.parquet")
    gc.collect()
    gc.disable()
    try:
        totals = simulator.run(requests, checkpoint=tmp_path / "state.npz", checkpoint_every_s=0.0, table=table).totals
        assert gc.collect() == 0
        stats = simulator.store.stats()
    finally:
        gc.enable()
        table.close()
        simulator.close()
    assert totals.hit_tokens_ram and totals.hit_tokens_ssd
    assert totals.window_hits_ssd or workload == "trace"  # (a trace's turns resume no window state)
    assert stats.tiers["ram"].evictions and stats.tiers["ssd"].expirations
    # With the collector on, the run hands it back on, holding no frozen objects.
    simulate(SimConfig(SIZES), _turns(0.0, 60.0))
    assert gc.isenabled() and gc.get_freeze_count() == 0


def _live_children(pid: int) -> list[int]:
    """The policy processes (spawned children) whose parent is ``pid`` and that have not
    exited (Linux ``/proc``: a zombie counts as exited)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, parent = stat.read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if int(parent) == pid and state != "Z" and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.e2e
def test_a_killed_command_takes_its_policy_processes_with_it():
    """A job scheduler's SIGTERM, or SIGKILL, ends `cache-sim run` without its cleanup:
    the policies' processes must not run on without it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    command = subprocess.Popen([sys.executable, "-m", "cluster.cli", "cache-sim", "run", "--profile", "agent",
                                "--sessions", "1000000", "--hours", "96", "--no-checkpoint"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(children) < 2 and time.monotonic() < deadline:  # the two policies' (not the resource tracker)
            children = _live_children(command.pid)
            time.sleep(0.2)
        assert len(children) == 2
        command.send_signal(signal.SIGKILL)
        command.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, children))
    finally:
        command.kill()
        for pid in children:  # (a failure leaves none behind either)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_tenant_mix_keeps_each_tenants_cache_as_it_asked():
    """``SimConfig.tenants``: one tenant asking 72 h is the deployment without tenants,
    one asking 24 h is the deployment at 24 h retention (counter for counter); in a mix,
    the tenants' counts add up to the run's, a tenant asking ``in_memory`` never hits
    nor holds anything on SSD, and tenants share no chunk."""
    from cluster.lab.sessions import synthetic
    from cluster.lab.sim_config import TenantShare
    from cluster.lab.workload import Profile
    from dataclasses import asdict

    profile = Profile.named("agent", sessions=80, hours=60)
    base = dict(ram_bytes=300_000, hours=60)

    def run(**overrides):
        return simulate(SimConfig(SIZES, **{**base, **overrides}), synthetic(profile))

    plain, day = run(), run(chunk_retention_hours=24.0)
    assert asdict(run(tenants=TenantShare.parse("all=1:72h")).totals) == asdict(plain.totals)
    assert asdict(run(tenants=TenantShare.parse("all=1:24h")).totals) == asdict(day.totals)
    assert day.totals.hit_tokens_ssd < plain.totals.hit_tokens_ssd  # (the workload returns after a day)
    mix = run(tenants=TenantShare.parse("a=0.5:72h,b=0.3:24h,c=0.2:in_memory"))
    by_name = {t["name"]: t for t in mix.tenants}
    for field in ("requests", "input_tokens", "hit_tokens_ram", "hit_tokens_ssd", "chunk_bytes_written",
                  "window_bytes_written", "prefill_tokens"):
        assert sum(t["totals"][field] for t in mix.tenants) == getattr(mix.totals, field), field
    assert all(t["totals"]["requests"] > 0 for t in mix.tenants)
    assert by_name["c"]["totals"]["hit_tokens_ssd"] == 0 and by_name["c"]["held_bytes"]["ssd"] == 0
    assert by_name["a"]["held_bytes"]["ssd"] > 0
    assert mix.totals.hit_tokens_ram + mix.totals.hit_tokens_ssd < plain.totals.hit_tokens_ram + \
        plain.totals.hit_tokens_ssd  # shared system prompts are no longer shared across tenants
    with pytest.raises(ValueError, match="add up to 1"):
        TenantShare.parse("a=0.5:72h,b=0.4:24h")
    with pytest.raises(ValueError, match="48h"):
        TenantShare.parse("a=1:48h")
