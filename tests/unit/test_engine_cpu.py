"""Engine threads' CPU claims (actors/engine_cpu.py): highest free CPU first, one
holder each, let go when the holder's process ends, never in a folder that is not the
user's own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from actors.engine_cpu import claim_cpu

pytestmark = pytest.mark.unit

CPUS = sorted(os.sched_getaffinity(0), reverse=True)


def _claim_in_a_process(folder, hold: bool = False) -> subprocess.Popen:
    code = ("import sys, time; from pathlib import Path; from actors.engine_cpu import claim_cpu; "
            f"print(claim_cpu(Path({str(folder)!r})), flush=True); time.sleep(60 if {hold} else 0)")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


@pytest.mark.skipif(len(CPUS) < 2, reason="one CPU: nothing to claim")
def test_claims_go_highest_first_one_holder_each_until_the_holder_ends(tmp_path):
    folder = tmp_path / "claims"
    holder = _claim_in_a_process(folder, hold=True)
    try:
        assert int(holder.stdout.readline()) == CPUS[0]
        assert [claim_cpu(folder) for _ in CPUS] == [*CPUS[1:], None]
    finally:
        holder.kill()
        holder.wait()
    done = _claim_in_a_process(folder)
    assert int(done.stdout.readline()) == CPUS[0]  # the killed holder's CPU is free again
    assert done.wait() == 0
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert {oct(f.stat().st_mode & 0o777) for f in folder.iterdir()} == {"0o600"}


def test_no_claim_in_a_folder_others_may_write(tmp_path):
    folder = tmp_path / "claims"
    folder.mkdir(mode=0o700)
    folder.chmod(0o777)
    assert claim_cpu(folder) is None
    assert list(folder.iterdir()) == []


def test_no_claim_for_a_process_on_one_cpu(tmp_path):
    code = ("import os; from pathlib import Path; from actors.engine_cpu import claim_cpu; "
            f"os.sched_setaffinity(0, {{{CPUS[-1]}}}); print(claim_cpu(Path({str(tmp_path)!r})))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "None"
