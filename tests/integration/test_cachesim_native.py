"""The retention lab's compiled build (``cluster.lab.native``): mypyc's C of the
store, the tiers, the simulator and the sessions' loop counts exactly what the plain
Python does, checkpoints included; a build follows its sources; no build, no harm.

Run as a script (``python test_cachesim_native.py BUILD CHECKPOINT``) this file is the
compiled side of the comparison: it loads the build before anything it compiles."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _scenario(checkpoint: Path) -> dict:
    """Both policies on a small agent workload whose tiers are tight enough that every
    path runs (evictions from RAM and SSD, expirations, promotions), whole and killed at
    hour 6 then resumed from a checkpoint; the outcome as JSON-able values."""
    from dataclasses import asdict

    from cluster.lab import native
    from cluster.lab.sim_config import SimConfig
    from cluster.lab.simulate import Simulator, simulate
    from cluster.lab.sizes import Sizes
    from cluster.lab.sessions import synthetic
    from cluster.lab.workload import CHUNK_TOKENS, Profile

    class Killed(Exception):
        pass

    def kill_at_hour_6(now_s, _requests):
        if now_s >= 6 * 3600:
            raise Killed

    out: dict = {"compiled": native.active()}
    profile = Profile.named("agent", sessions=300, hours=12)
    for persist in (False, True):
        sizes = Sizes("test", CHUNK_TOKENS, chunk_bytes=1000, window_bytes=5000, persist_windows=persist,
                      source="test")
        config = SimConfig(sizes, ram_bytes=2_000_000, ssd_bytes=15_000_000, chunk_retention_hours=2.0, hours=12)
        whole = simulate(config, synthetic(profile))
        with contextlib.suppress(Killed), Simulator(config) as simulator:
            simulator.run(synthetic(profile), kill_at_hour_6, checkpoint=checkpoint, checkpoint_every_s=0.0)
        with Simulator(config) as simulator:
            resumed = simulator.run(synthetic(profile), checkpoint=checkpoint)
        out[f"persist={persist}"] = {"totals": asdict(whole.totals), "store": whole.store,
                                     "samples": [asdict(s) for s in whole.samples],
                                     "resumed": asdict(resumed.totals), "resumed_store": resumed.store}
    return out


@pytest.mark.slow
def test_the_compiled_simulator_counts_what_the_plain_one_does(tmp_path):
    from cluster.lab import native

    build = native.build()
    assert build.ok, build.reason  # the project depends on mypy, and a C compiler is there: a failure is a defect
    done = subprocess.run([sys.executable, __file__, str(build.directory), str(tmp_path / "compiled.npz")],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    plain = _scenario(tmp_path / "plain.npz")
    assert compiled["compiled"] and not plain["compiled"]
    for policy in ("persist=False", "persist=True"):
        c, p = compiled[policy], plain[policy]
        assert c == p  # every counter, every tier's contents each virtual hour, the resumed run's
        assert c["resumed"] == c["totals"] and c["resumed_store"] == c["store"]
        tiers = c["store"]["tiers"]
        assert c["totals"]["requests"] > 5000 and c["totals"]["hit_tokens_ssd"] > 0
        assert tiers["ram"]["evictions"] and tiers["ssd"]["evictions"] and tiers["ssd"]["expirations"]
    # V4's persisted windows are read back from SSD; V4.1's never go there.
    assert compiled["persist=True"]["totals"]["window_hits_ssd"] > 0 == compiled["persist=False"]["totals"][
        "window_hits_ssd"]


def test_a_build_follows_its_sources(tmp_path):
    from cluster.lab import native

    root = tmp_path / "src"
    for top in native.SOURCES:
        shutil.copytree(native.ROOT / top, root / top, ignore=shutil.ignore_patterns("__pycache__"))
    key = native.build_key(root)
    assert key == native.build_key(root) and len(key) == 24
    store = root / "storage" / "store.py"
    store.write_text(store.read_text() + "\n# edited\n")
    assert native.build_key(root) != key  # an edit is never shadowed by an old build
    store.write_text(store.read_text().removesuffix("\n# edited\n"))
    assert native.build_key(root) == key
    # A module the compiled ones are typed against, though not compiled itself.
    keys = root / "storage" / "keys.py"
    keys.write_text(keys.read_text() + "\n")
    assert native.build_key(root) != key


def test_without_a_c_compiler_there_is_no_build_and_a_reason(tmp_path, monkeypatch):
    from cluster.lab import native

    monkeypatch.setenv("CC", "false")
    build = native.build(tmp_path)
    assert not build.ok and "failed" in build.reason
    assert not any(p.is_dir() and not p.name.startswith(".") for p in tmp_path.iterdir())  # nothing half-built kept
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # the staging copy is gone
    # A cache that cannot be made (a file where its folder would be): no build, no exception.
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    build = native.build(blocked / "cache")
    assert not build.ok and "failed" in build.reason


def test_a_process_that_already_runs_the_plain_modules_is_not_switched(tmp_path):
    import storage.store  # noqa: F401 (plain Python, as the tests run it)
    from cluster.lab import native

    with pytest.raises(RuntimeError, match="storage.store"):
        native.activate(tmp_path)
    assert not native.active()


if __name__ == "__main__":
    from cluster.lab import native as _native

    _native.activate(Path(sys.argv[1]))
    print(json.dumps(_scenario(Path(sys.argv[2]))))
