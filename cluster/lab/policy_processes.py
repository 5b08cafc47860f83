"""Each storage policy's simulation in a process of its own (``v41 cache-sim run``).

The processes run at once (one per policy), start with their heap on transparent huge
pages, may load the compiled build (:mod:`cluster.lab.native`), end with the command
that started them, and send back their results (or their errors, raised in the
caller). A policy's simulation saves and resumes its checkpoint and draws its own
progress bar on stderr.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path

# A simulation's processes keep their heap on transparent huge pages (see in_policy_processes).
HUGE_PAGE_ENV = {"PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
_kept: list = []  # what a policy process holds until it exits (see _policy_process)


def in_policy_processes(calls: list[tuple], native: Path | None = None) -> list[dict]:
    """``simulate_policy(*call)`` for each call, each in a process of its own, all at once;
    their results, in order. ``native``: a build of ``cluster.lab.native`` the
    processes run (None: plain Python).

    The processes are spawned with their heap on transparent huge pages: every Python
    object through glibc's malloc (``PYTHONMALLOC=malloc``), which asks for huge pages
    where the kernel gives them on request (``madvise``, the common default; glibc >=
    2.35). A million-session run holds tens of millions of index entries in gigabytes,
    and each request looks up a few of them at random: with 4 KiB pages most of those
    look-ups also miss the TLB. Same results; on a 2-core Intel Xeon, 400,000 agent
    sessions (2.1 GB) ran in 0.92x the time, the million in 0.90x. Elsewhere (no THP,
    another libc) the variables are ignored or cost ~2%.

    A process sends its result and exits at once, without freeing its store's objects
    one by one: the million-session run's wall was 58 s over its slower process's
    simulation when they did, 5 s since.
    """
    context = multiprocessing.get_context("spawn")  # not forked: the variables take effect when a process starts
    saved = {name: os.environ.get(name) for name in HUGE_PAGE_ENV}
    tunables = os.environ.get("GLIBC_TUNABLES")
    os.environ.update(HUGE_PAGE_ENV)
    if tunables:
        os.environ["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGE_ENV['GLIBC_TUNABLES']}"
    children = []
    try:
        for call in calls:
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_policy_process, args=(sender, call, native), daemon=True)
            process.start()
            sender.close()
            children.append((process, receiver))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    results = []
    try:
        for process, receiver in children:
            try:
                ok, value = receiver.recv()
            except EOFError:
                process.join()
                raise RuntimeError(f"a simulation's process died (exit code {process.exitcode})") from None
            if not ok:
                raise value
            results.append(value)
            process.join()
    finally:
        for process, _ in children:
            if process.is_alive():
                process.terminate()
    return results


def _policy_process(sender, call: tuple, native: Path | None = None) -> None:
    _exit_with_parent()
    try:
        if native is not None:
            from cluster.lab.native import activate

            activate(native)
        outcome = (True, simulate_policy(*call))
    except BaseException as error:  # noqa: BLE001 (any of them, Ctrl-C too: the caller raises it)
        error.add_note(f"in the {call[0]} policy's process:\n{traceback.format_exc()}")
        outcome = (False, error)
    sender.send(outcome)
    sender.close()
    os._exit(0)  # the simulator in _kept is not freed object by object: the OS takes the memory back at once


def _exit_with_parent() -> None:
    """End this process when the command's process ends. A command killed outright (SIGTERM
    from a job scheduler, SIGKILL) cannot terminate its children, which would otherwise run
    on for the rest of a half-hour simulation each, holding a core and gigabytes."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])  # readable once the parent is gone
        os._exit(1)

    threading.Thread(target=watch, name="v41-cache-sim-parent", daemon=True).start()


def _requests(spec):
    from cluster.lab import sessions, workload

    if spec[0] == "trace":
        return workload.mooncake(spec[1], stretch=spec[2], tile=spec[3])
    return sessions.synthetic(workload.Profile.model_validate(spec[1]))


def simulate_policy(policy: str, config_fields: dict, spec, show_progress: bool, checkpoint_dir: str | None = None,
                    table_path: str | None = None) -> dict:
    """One policy's simulation of the workload ``spec`` (``("trace", path, stretch,
    tile)`` or ``("synthetic", profile fields)``): its summary, as plain values. The lab's
    modules are imported here, after the process has loaded the compiled build."""
    import torch

    from cluster.lab import sizes as sizes_module
    from cluster.lab.native import active
    from cluster.lab.request_table import RequestTable
    from cluster.lab.sim_config import SimConfig, TenantShare
    from cluster.lab.simulate import Simulator

    torch.set_num_threads(1)
    model = config_fields.pop("model")
    sizes = sizes_module.v4_flash() if policy == "v4" else (
        sizes_module.from_config(model) if model else sizes_module.from_config())
    tenants = config_fields.get("tenants")
    config = SimConfig(sizes, **{**config_fields, "tenants": TenantShare.parse(tenants) if tenants else ()})
    checkpoint = None
    if checkpoint_dir is not None and config.mode == "scale":  # one file per policy, workload and settings
        tag = hashlib.sha1(json.dumps([policy, config_fields, model, spec], sort_keys=True).encode()).hexdigest()
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        checkpoint = Path(checkpoint_dir) / f"{policy}-{tag[:16]}.npz"
        if checkpoint.exists() and show_progress:
            print(f"resuming from {checkpoint}", file=sys.stderr)
    table = RequestTable(Path(table_path)) if table_path else None
    progress = _progress_bar(policy, config.hours) if show_progress else None
    with tempfile.TemporaryDirectory(prefix="v41-cache-sim-") as directory:
        simulator = Simulator(config, directory)
        _kept.append(simulator)  # never closed: its process exits without freeing it
        result = simulator.run(_requests(spec), progress, checkpoint=checkpoint, checkpoint_every_s=120.0, table=table)
    if table is not None:
        table.close()
    if show_progress:
        print(file=sys.stderr)
    samples = result.samples
    stored = [sum(s.bytes.values()) for s in samples]
    return {"policy": policy, "compiled": active(), "sizes": sizes.as_dict(), "rates": result.rates,
            "totals": asdict(result.totals),
            "store": result.store, "virtual_hours": result.virtual_s / 3600, "wall_s": result.wall_s,
            "mean_stored_bytes": sum(stored) / max(1, len(stored)),
            "peak_stored_bytes": max(stored, default=0), "tenants": result.tenants,
            "samples": [asdict(s) for s in samples]}


def _progress_bar(policy: str, hours: float | None):
    """The simulator's progress callback: virtual hours, requests and seconds on one
    stderr line; with ``hours``, a bar and the time left at this pace."""
    started = time.time()
    first: list[float] = []  # the virtual hour this process started from (a resumed run's is not 0)

    def progress(now_s: float, requests: int) -> None:
        first[:] = first or [now_s]
        elapsed = time.time() - started
        line = f"\r{policy}: {now_s / 3600:6.1f} virtual h | {requests:,} requests | {elapsed:6.0f} s"
        if hours:  # a bar, and the time left at this pace
            done = min(1.0, now_s / (hours * 3600))
            pace = (now_s - first[0]) / max(1e-9, elapsed)
            left = f"~{(hours * 3600 - now_s) / pace:5.0f} s left" if pace > 0 else "  ? s left"
            line = f"\r{policy}: [{'#' * int(30 * done):<30}] {done:4.0%} | {requests:,} requests | {elapsed:5.0f} s, {left}"
        print(line, end="", file=sys.stderr, flush=True)

    return progress
