"""`v41 bench store` end to end on the embedded Redis, which refuses FLUSHALL: the bench
empties it key by key between sizes (it crashed on FLUSHALL after the Redis was locked down)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_the_store_bench_runs_every_tier_at_two_sizes(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "store", "--sizes", "1,4", "--reps", "1",
                           "--dir", str(tmp_path), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {(row["tier"], row["size_kib"], row["op"]) for row in report["rows"]}
    assert rows == ({(tier, size, op) for tier in ("ram", "ssd", "redis") for size in (1, 4) for op in ("get", "put")}
                    | {("ssd-mac", size, "get") for size in (1, 4)})
    assert all(row["store_mb_s"] > 0 and row["raw_mb_s"] > 0 for row in report["rows"])
    for tier in ("ssd", "ssd-mac"):
        assert report[f"{tier.replace('-', '_')}_get_ratio"] == min(
            row["ratio"] for row in report["rows"] if row["tier"] == tier and row["op"] == "get")
    assert list(tmp_path.iterdir()) == []  # its work folder is gone
