"""The Engram service on a host of its own (cluster/hosts.py): `v41 bench engram --hosts 2`
runs the bench on a head host and its table shards on an Engram host across a shaped
link, and the prefill fed by the service over that link encodes exactly what the
in-process tables give."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from cluster import hosts

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(hosts.available() is not None, reason=str(hosts.available()))]


def test_the_engram_shards_on_their_own_host_feed_a_prefill_across_the_link():
    done = subprocess.run(["v41", "bench", "engram", "--hosts", "2", "--link-gbit", "0.1", "--rows", "20000",
                           "--sizes", "256,1024", "--reps", "2", "--prefill-tokens", "256", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["hosts"] == 2 and result["link_gbit"] == 0.1
    assert result["prefill_identical"] is True
    assert [row["tokens"] for row in result["lookups"]] == [256, 1024]
    assert all(row["unique_rows"] > 0 and row["p50_ms"] > 0 for row in result["lookups"])
    run = re.search(r"this bench on 10\.241\.(\d+)\.1,", done.stdout).group(1)
    assert not [name for name in hosts.namespaces() if name.startswith(f"v41h-{run}-")]  # (nothing left behind)
