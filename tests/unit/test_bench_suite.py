"""`v41 bench all`: the tables' commands are valid commands, and a run reports the
machine's limits beside a bench's figures taken from its own JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.bench import BENCHES
from cluster.bench.suite import ROOT, SUITE, headline, loopback_round_trip_us, matmul_gflops

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("entry", SUITE, ids=lambda entry: entry.name)
def test_every_table_command_is_a_valid_command(entry):
    """A table's arguments parse as its bench's (so `bench all` runs what the README
    says, and a renamed option fails here, not an hour into a run)."""
    from cluster.cli import build_parser

    assert entry.bench in BENCHES and entry.bench != "all"
    args = build_parser("bench").parse_args(entry.argv)
    assert args.json and args._bench.__name__ == BENCHES[entry.bench][0]


def test_headline_figures_are_the_numbers_near_the_top():
    result = {"tokens_per_s": 12.5, "ok": True, "rows": [{"x": 1}], "name": "a",
              "decoder": {"kl": 0.25, "deep": {"x": 3}, "n": 4}}
    assert headline(result) == {"tokens_per_s": 12.5, "decoder.kl": 0.25, "decoder.n": 4}


def test_limits_are_measured():
    # A 256-cube product is 33.5 MFLOP: between 0.1 and 10,000 GFLOP/s on any CPU this runs on.
    assert 0.1 < matmul_gflops(1, n=256, repeats=2) < 10_000
    assert 1 < loopback_round_trip_us(200) < 100_000


@pytest.mark.slow
@pytest.mark.e2e
def test_a_run_prints_the_limits_beside_the_figures_of_its_benches():
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "all", "--only", "store", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    limits = report["limits"]
    assert set(limits) == {"matmul_gflops_1_thread", "matmul_gflops_all_cores", "copy_gb_s", "disk_write_gb_s",
                           "loopback_round_trip_us"} and all(value > 0 for value in limits.values())
    (name,) = report["benches"]
    bench = report["benches"][name]
    assert name == "store" and bench["returncode"] == 0 and bench["command"] == "v41 bench store --json"
    assert bench["figures"] == headline(bench["result"])
    assert set(bench["figures"]) == ({f"{tier}_{op}_ratio" for tier in ("ram", "ssd", "redis") for op in ("get", "put")}
                                     | {"ssd_mac_get_ratio"})
    assert all(0 < ratio < 10 for ratio in bench["figures"].values())  # (a tier over the raw medium it stands on)
    # The bench's own table comes through, then the summary: each figure beside its limits.
    assert "ssd_get_ratio" in out.stdout and "headline figures" in out.stdout
    line = next(line for line in out.stdout.splitlines() if line.startswith("store") and "ssd_get_ratio" in line)
    assert f"disk_write_gb_s {limits['disk_write_gb_s']}" in line and f"copy_gb_s {limits['copy_gb_s']}" in line
    bad = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "all", "--only", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "no table named nope" in bad.stderr
