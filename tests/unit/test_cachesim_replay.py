"""The trace replay behind `v41 cache-sim validate`: the slice, the prompts, and the
command against a live `v41 serve` (slow: it starts one)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.lab import replay, workload

pytestmark = pytest.mark.unit

ROWS = [
    {"timestamp": 0, "input_length": 1500, "output_length": 300, "hash_ids": [0, 1, 2]},
    {"timestamp": 10, "input_length": 700, "output_length": 1, "hash_ids": [0, 5]},
    {"timestamp": 20, "input_length": 2100, "output_length": 9, "hash_ids": [0, 1, 2, 3, 4]},
    {"timestamp": 30, "input_length": 900, "output_length": 9, "hash_ids": [0, 6]},
    {"timestamp": 90_000, "input_length": 900, "output_length": 9, "hash_ids": [0, 1]},
]


def test_the_slice_takes_whole_conversations_within_the_minutes_and_cuts_prompts():
    rows = replay.trace_slice(ROWS, conversations=2, minutes=1.0, max_prompt_tokens=1100, max_output_tokens=4)
    # Conversations 1 and 5 (the block after the shared root); 6 is a third; the last
    # row is past the minute.
    assert [row["hash_ids"] for row in rows] == [[0, 1, 2], [0, 5], [0, 1, 2]]
    assert [row["input_length"] for row in rows] == [1100, 700, 1100]
    assert [row["output_length"] for row in rows] == [4, 2, 4]  # at least 2: the window key holds an answer token


def test_prompts_share_exactly_the_tokens_their_blocks_share():
    a, b, c = (replay.prompt_ids(row, vocab_size=4096) for row in ROWS[:3])
    assert len(a) == 1500 and len(c) == 2100 and all(16 <= t < 4096 for t in a + b + c)
    assert c[:1500] == a  # blocks 0, 1, 2 in both
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert 512 - 8 < shared <= 512  # block 0 only (two random runs may agree on a token or so)
    assert replay.prompt_ids(ROWS[0], 4096) == a  # seeded by the block id


def test_replayed_rows_become_simulator_requests_with_their_measured_ends():
    requests = list(workload.trace_requests(ROWS[:2], done_s=[5.0, 6.0]))
    assert [r.done_s for r in requests] == [5.0, 6.0]
    assert requests[0].runs == ((0, 0, 4), (1, 0, 4), (2, 0, 3))  # 1500 tokens: 11 full chunks of 128


@pytest.mark.slow
@pytest.mark.e2e
def test_validate_agrees_with_a_live_cluster_across_a_store_restart():
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "cache-sim", "validate", "--conversations", "4",
                          "--minutes", "10", "--max-prompt-tokens", "2000", "--speedup", "20", "--json"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["requests"] >= 6 and report["restart_at_s"] is not None
    assert report["live"]["hit_rate_ssd"] > 0 and report["live"]["hit_rate_ram"] > 0  # both tiers were exercised
    assert report["max_abs_hit_rate_diff"] <= 0.02, out.stdout[-4000:]  # the turns that differ, if any


def test_the_report_writes_its_tables_plots_and_markdown(tmp_path):
    import pyarrow.parquet as pq

    from cluster.lab.report import RETENTIONS_H, Cost, jobs, run_all

    summary = run_all(tmp_path, agent_sessions=12, agent_hours=6.0, workers=2, trace_rows=400)
    runs = pq.read_table(tmp_path / "runs.parquet").to_pylist()
    assert len(runs) == len(jobs(12, 6.0)) == summary["runs"]
    for workload in ("conversation", "agent"):
        for policy in ("v41", "v4"):
            sweep = sorted((r for r in runs if r["experiment"] == "retention" and r["workload"] == workload
                            and r["policy"] == policy), key=lambda r: r["retention_h"])
            assert [r["retention_h"] for r in sweep] == list(RETENTIONS_H)
            hits = [r["hit_rate"] for r in sweep]
            assert hits == sorted(hits)  # keeping chunks longer never loses a hit (unbounded SSD)
            assert all(abs(r["hit_rate"] - r["hit_rate_ram"] - r["hit_rate_ssd"]) < 1e-9 for r in sweep)
        w = summary["workloads"][workload]
        assert 0 < w["stored_bytes_v41_over_v4"] < 1  # V4 keeps window states and 4x bigger chunks
    samples = pq.read_table(tmp_path / "samples.parquet").to_pylist()
    assert {(s["workload"], s["policy"]) for s in samples} == {(w, p) for w in ("conversation", "agent")
                                                               for p in ("v41", "v4")}
    agent = next(r for r in runs if r["experiment"] == "retention" and r["workload"] == "agent"
                 and r["policy"] == "v41" and r["retention_h"] == 72.0)
    # The cost model: every hit token saves its prefill time less its load.
    cost = Cost()
    prefill_s = (agent["hit_tokens_ram"] + agent["hit_tokens_ssd"]) / cost.prefill_tokens_per_s
    assert agent["ttft_saved_ms_per_request"] < 1e3 * prefill_s / agent["requests"]
    assert agent["ttft_saved_ms_per_request"] + agent["load_ms_per_request"] == \
        pytest.approx(1e3 * prefill_s / agent["requests"])
    for name in ("hit_rate_vs_retention.png", "bytes_per_tier_over_time.png", "window_states.png", "ssd_sizing.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "report.md").read_text()
    assert "Stored bytes V4.1 / V4" in text and "![SSD sizing](ssd_sizing.png)" in text
    # At a deployment's scale: one node's share of a fleet's traffic in a 10% RAM pool,
    # against the retention; longer never loses a hit, and only SSD holds past the RAM.
    from cluster.lab import deployment

    scale = summary["deployment"]
    assert list(scale["retention"]) == [f"{r:g}" for r in deployment.RETENTIONS_H]
    assert scale["sessions_per_node"] == 12 * deployment.LOAD and scale["ram_gb_per_node"] == 204.8
    hits = [r["hit_rate"] for r in scale["retention"].values()]
    assert hits == sorted(hits)
    assert all(r["peak_ssd_tb_fleet"] == pytest.approx(r["peak_ssd_tb_per_node"] * deployment.NODES, abs=0.01)
               for r in scale["retention"].values())
    assert f"## At a deployment's scale ({deployment.NODES} nodes)" in text
    assert json.loads((tmp_path / "summary.json").read_text())["runs"] == summary["runs"]
