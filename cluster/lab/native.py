"""The retention lab's hot code compiled to C with mypyc, for ``v41 cache-sim run``.

A scale-mode run spends its time in Python's interpreter: the store's read and write
paths, the RAM and SSD tiers' LRU bookkeeping, the simulator's events. mypyc compiles
those modules, the same source and the same semantics, into C extensions; a policy's
process loads them in place of the ``.py`` files, and nothing else changes (the
counters are identical: ``test_the_compiled_simulator_counts_what_the_plain_one_does``).

The build is derived, never checked in: it is made on first use (~25 s on two cores)
into ``~/.cache/v41/cache-sim-native/<key>``, where the key hashes the Python and mypyc
versions and every source file the compiled modules are typed against, so an edited
source is never shadowed by a stale build. Without mypyc or a C compiler, or where the
build fails, the run goes on as plain Python and says so.

Only the processes of ``v41 cache-sim run`` load the build (:func:`activate`, before
any of these modules is imported): the server, the tests and everything else run the
plain source.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Compiled: the RAM and SSD tiers' LRU code, the store's read and write paths, the
# simulator's events with its settings, counters and request table, the synthetic
# sessions' loop. storage/sized.py stays plain Python (a compiled class cannot subclass
# bytes), and so does workload.py (pydantic).
COMPILED = ("storage/metrics.py", "storage/tier.py", "storage/ram_tier.py", "storage/ssd_tier.py",
            "storage/store.py", "cluster/lab/sim_config.py", "cluster/lab/counts.py", "cluster/lab/request_table.py",
            "cluster/lab/simulate.py", "cluster/lab/sessions.py")
# What the compiled modules are typed against (hashed into the key; the packages whose
# __path__ activate() extends).
SOURCES = ("storage", "cluster/lab")
PACKAGES = ("storage", "cluster.lab")
GROUP = "v41_cache_sim"

# The build, in the staging copy of the sources: mypy follows our own packages and no
# other (analysing numpy, torch and pydantic took a minute and a half; their values are
# objects to the compiled code, where stubs do not say otherwise).
_MYPY_INI = """[mypy]
follow_imports = skip
ignore_missing_imports = True
[mypy-storage.*,cluster.*]
follow_imports = silent
"""
_BUILD = """
import sys
from mypyc.build import mypycify
from setuptools import setup

setup(name="v41-cache-sim-native", script_args=["build_ext", "--inplace"],
      ext_modules=mypycify(["--config-file=mypy.ini", *sys.argv[2:]], opt_level="3", debug_level="0",
                           group_name=sys.argv[1]))
"""


@dataclass(frozen=True)
class Build:
    """Where a compiled build is, or why there is none."""

    directory: Path | None
    reason: str = ""  # why there is no build (directory None)
    built_s: float = 0.0  # seconds this call spent compiling (0: found in the cache)

    @property
    def ok(self) -> bool:
        return self.directory is not None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "v41" / "cache-sim-native"


def _module(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def _sources(root: Path = ROOT) -> list[Path]:
    return sorted(p for top in SOURCES for p in (root / top).rglob("*.py"))


def build_key(root: Path = ROOT) -> str:
    """The hash of what a build depends on: the interpreter, mypyc, every source it is typed against."""
    digest = hashlib.sha256()
    digest.update(f"{sys.version}|{sysconfig.get_platform()}|{_mypyc_version()}|{COMPILED}".encode())
    for path in _sources(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def _mypyc_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mypy")
    except PackageNotFoundError:
        return ""


def build(cache: Path | None = None, log=None) -> Build:
    """The compiled modules for this source, from the cache or built now (``log``: a
    file to tell of a build that starts). Never raises: a failure is a :class:`Build`
    without a directory, and the reason."""
    if importlib.util.find_spec("mypyc") is None:
        return Build(None, "mypyc is not installed (pip install mypy)")
    cache = cache_root() if cache is None else Path(cache)
    key = build_key()
    target = cache / key
    if (target / "ok").exists():
        return Build(target)
    if log is not None:
        print(f"compiling the simulator's hot code with mypyc into {target} (once per version of the code, "
              "~25 s)...", file=log, flush=True)
    started = time.perf_counter()
    staging = None
    try:
        cache.mkdir(parents=True, exist_ok=True)  # (a home that cannot be written: no build, as any failure)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache))
        for path in _sources():
            copy = staging / path.relative_to(ROOT)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)
        for package in ("cluster",):  # the parents of SOURCES that are packages themselves
            shutil.copyfile(ROOT / package / "__init__.py", staging / package / "__init__.py")
        (staging / "mypy.ini").write_text(_MYPY_INI)
        done = subprocess.run([sys.executable, "-c", _BUILD, GROUP, *COMPILED], cwd=staging, check=False,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(staging)})
        (cache / f"{key}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            return Build(None, f"the mypyc build failed (log: {cache / f'{key}.log'}): {' | '.join(tail)}")
        out = staging / "out"
        for library in [p for p in staging.rglob("*.so") if "build" not in p.relative_to(staging).parts]:
            place = library.relative_to(staging)
            moved = out / (place if len(place.parts) > 1 else Path("lib") / place)
            moved.parent.mkdir(parents=True, exist_ok=True)
            library.rename(moved)
        (out / "ok").write_text(key)
        try:
            out.rename(target)
        except OSError:
            if not (target / "ok").exists():  # (another process's build landed first: use it)
                raise
        return Build(target, built_s=time.perf_counter() - started)
    except OSError as error:
        return Build(None, f"the mypyc build failed: {error}")
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def activate(directory: Path) -> None:
    """Make this process import the compiled modules in ``directory``: call it before
    any of them is imported."""
    loaded = [_module(path) for path in COMPILED if _module(path) in sys.modules]
    if loaded:
        raise RuntimeError(f"activate() comes too late: {', '.join(loaded)} already imported as plain Python")
    for name in PACKAGES:  # (their __init__ from the source: plain Python)
        package = importlib.import_module(name)
        package.__path__.insert(0, str(directory / name.replace(".", "/")))
    sys.path.insert(0, str(directory / "lib"))  # the group's shared library, a top-level module


def active() -> bool:
    """Whether this process runs the compiled modules."""
    module = sys.modules.get("storage.store")
    return module is not None and not (module.__file__ or "").endswith(".py")
