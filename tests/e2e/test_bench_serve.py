"""`v41 bench serve`'s arguments: a count it cannot run is a one-line error before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["cold", "returning", "repeats"])
def test_counts_below_one_are_one_line_errors(name):
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "serve", f"--{name}", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and done.stderr.strip() == f"v41 bench: error: --{name} must be at least 1, got 0"


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--clients", "1,x", "--clients must be comma-separated counts of at least 1, got '1,x'"),
    ("--clients", "0,4", "--clients must be comma-separated counts of at least 1, got '0,4'"),
    ("--tokens", "1", "--tokens must be at least 2, got 1"),
])
def test_streams_that_cannot_be_measured_are_one_line_errors(flag, value, message):
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "serve", flag, value], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and done.stderr.strip() == f"v41 bench: error: {message}"
