"""`v41 bench all`: every benchmark table of docs/, regenerated in one run,
each figure printed beside the machine's raw limits measured in the same run.

First the limits (a few seconds): fp32 matmul throughput on one thread and on every
core, an in-memory copy, a file written and fsynced, a loopback TCP round trip. Then
each benchmark with the arguments of the table it regenerates (:data:`SUITE`), in a
process of its own as the docs run it; its table is printed as it comes. Last, one
table of every bench's headline figures (the numbers near the top of its JSON), each
beside the limits that bound it. With ``--json``, one object: the limits, and per bench
its command, exit status, seconds, JSON and figures.

A full run takes about an hour on 2 cores (``agents``, ``load`` and ``serve`` start
clusters); ``--only`` / ``--skip`` pick benches, ``--list`` prints the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the docs' commands run from the repository root


@dataclass(frozen=True)
class Entry:
    """One table: the bench, the arguments the table was measured with, where it is, and
    the raw limits its figures stand against."""

    name: str
    bench: str
    args: tuple[str, ...]
    table: str
    limits: tuple[str, ...]

    @property
    def argv(self) -> list[str]:
        """The arguments of `v41` that run it."""
        return ["bench", self.bench, *self.args, "--json"]

    @property
    def command(self) -> str:
        """The command as the docs write it."""
        return " ".join(["v41", *self.argv])


_COMPUTE = ("matmul_gflops_1_thread", "copy_gb_s")
_CLUSTER = ("matmul_gflops_all_cores", "loopback_round_trip_us")
SUITE: tuple[Entry, ...] = (
    Entry("engine", "engine", (), "docs/engine.md; docs/performance.md: Numbers", _COMPUTE),
    Entry("replay", "replay", ("tests/golden/A", "--prompt-tokens", "300"), "docs/engine.md", _COMPUTE),
    Entry("serve", "serve", ("--model", "tests/golden/A", "--history", "17000"), "docs/serving.md", _CLUSTER),
    Entry("agents", "agents", ("--model", "tests/golden/A", "--sessions", "32", "--seconds", "120"),
          "docs/serving.md", _CLUSTER),
    Entry("load", "load", ("--clients", "64", "--seconds", "60"), "docs/reliability.md: Load", _CLUSTER),
    Entry("tools", "tools", (), "docs/serving.md; docs/training.md", _COMPUTE),
    Entry("grammar", "grammar", (), "docs/serving.md", _COMPUTE),
    Entry("spec", "spec", ("--repeats", "4"), "docs/dspark.md: In short", _COMPUTE),
    Entry("peer", "peer", ("--checkpoint", "configs/small"), "docs/performance.md: Against the reference", _COMPUTE),
    Entry("peer-exact", "peer", ("--checkpoint", "configs/small", "--exact-replay"),
          "docs/performance.md: Against the reference", _COMPUTE),
    Entry("spec-batch16", "spec", ("--batches", "16", "--fixed", "3,4,5", "--repeats", "10"),
          "docs/benchmarks.md: DSpark speculative decoding", _COMPUTE),
    Entry("store", "store", (), "docs/storage.md", ("disk_write_gb_s", "copy_gb_s")),
    Entry("engram", "engram", (), "docs/engram.md", ("copy_gb_s",)),
    Entry("experts", "experts", (), "docs/scale.md", ("matmul_gflops_all_cores", "copy_gb_s")),
    Entry("vision", "vision", ("--tower", "small", "--repeats", "2", "--sizes", "544x544,768x1024"),
          "docs/images.md: Measured", _COMPUTE),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(entry.name for entry in SUITE)
    parser.add_argument("--only", default=None, help=f"comma-separated tables to run (of: {names})")
    parser.add_argument("--skip", default="", help="comma-separated tables not to run")
    parser.add_argument("--list", action="store_true", help="print the plan (tables, commands, limits) and stop")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a bench may take before it is stopped")


# ---------------------------------------------------------------------- raw limits


def _best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(threads: int, n: int = 1024, repeats: int = 5) -> float:
    """fp32 ``n x n @ n x n`` GFLOP/s (2 n^3 per product) on ``threads`` torch threads, best of ``repeats``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm
        return 2 * n**3 / _best_of(repeats, lambda: torch.mm(a, b, out=out)) / 1e9
    finally:
        torch.set_num_threads(before)


def copy_gb_s(megabytes: int = 512) -> float:
    """GB/s copied in memory (bytes of the source per second; one thread, best of 3)."""
    import numpy as np

    src = np.ones(megabytes << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # (the pages are touched before the timing)
    return src.nbytes / _best_of(3, lambda: np.copyto(dst, src)) / 1e9


def disk_write_gb_s(directory: str | Path | None = None, megabytes: int = 256) -> float:
    """GB/s of a file written in 4 MiB writes and fsynced, in ``directory`` (best of 2)."""
    block = os.urandom(4 << 20)
    count = max(1, megabytes >> 2)
    with tempfile.TemporaryDirectory(dir=directory, prefix="v41-bench-disk-") as tmp:
        path = Path(tmp) / "probe"

        def write() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for _ in range(count):
                    os.write(fd, block)
                os.fsync(fd)
            finally:
                os.close(fd)

        return count * len(block) / _best_of(2, write) / 1e9


def loopback_round_trip_us(trips: int = 2000) -> float:
    """Median microseconds of a 64-byte TCP ping-pong over 127.0.0.1 (a thread echoes)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(64):
                conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    samples = []
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        message = b"x" * 64
        for _ in range(trips):
            start = time.perf_counter()
            client.sendall(message)
            got = 0
            while got < len(message):
                got += len(client.recv(64))
            samples.append(time.perf_counter() - start)
    thread.join(5)
    server.close()
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def machine_limits() -> dict[str, float]:
    """Every raw limit, measured now."""
    return {
        "matmul_gflops_1_thread": round(matmul_gflops(1), 2),
        "matmul_gflops_all_cores": round(matmul_gflops(os.cpu_count() or 1), 2),
        "copy_gb_s": round(copy_gb_s(), 2),
        "disk_write_gb_s": round(disk_write_gb_s(), 3),
        "loopback_round_trip_us": round(loopback_round_trip_us(), 1),
    }


# ---------------------------------------------------------------------- the run


def headline(result: dict, depth: int = 2) -> dict[str, float]:
    """A bench's headline figures: the numbers in the top ``depth`` levels of its JSON
    objects, by dotted key (booleans and lists, the per-row tables, left out)."""
    figures = {}
    for key, value in result.items():
        if isinstance(value, dict) and depth > 1:
            figures.update({f"{key}.{inner}": v for inner, v in headline(value, depth - 1).items()})
        elif isinstance(value, int | float) and not isinstance(value, bool):
            figures[key] = value
    return figures


def _pick(spec: str | None, what: str) -> set[str]:
    from cluster import UserError

    names = {name.strip() for name in (spec or "").split(",") if name.strip()}
    unknown = names - {entry.name for entry in SUITE}
    if unknown:
        raise UserError(f"--{what}: no table named {', '.join(sorted(unknown))} "
                        f"(tables: {', '.join(entry.name for entry in SUITE)})")
    return names


def _run_one(entry: Entry, timeout_s: float) -> dict:
    """Run one bench, its output passed through as it comes; its JSON from the last line."""
    started = time.perf_counter()
    lines: list[str] = []
    process = subprocess.Popen([sys.executable, "-m", "cluster.cli", *entry.argv], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True, bufsize=1)
    timer = threading.Timer(timeout_s, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            lines.append(line)
            if not line.startswith("{"):  # the JSON goes into the summary, not the screen
                print(line, end="", flush=True)
        process.wait()
    finally:
        timer.cancel()
    result = None
    if process.returncode == 0 and lines:
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    return {"command": entry.command, "table": entry.table, "returncode": process.returncode,
            "seconds": round(time.perf_counter() - started, 1), "result": result,
            "figures": headline(result) if isinstance(result, dict) else {}, "limits": list(entry.limits)}


def run(args: argparse.Namespace) -> int:
    from cluster import UserError

    only, skip = _pick(args.only, "only"), _pick(args.skip, "skip")
    if args.timeout <= 0:
        raise UserError("--timeout must be positive")
    plan = [entry for entry in SUITE if (not only or entry.name in only) and entry.name not in skip]
    if args.list:
        for entry in plan:
            print(f"{entry.name:<13} {entry.command:<100} {entry.table}  "
                  f"[{', '.join(entry.limits)}]")
        return 0
    limits = machine_limits()
    print("machine limits, measured now: " + ", ".join(f"{key} {value}" for key, value in limits.items()), flush=True)
    benches = {}
    for entry in plan:
        print(f"\n== {entry.name}: {entry.command}  ({entry.table})", flush=True)
        benches[entry.name] = _run_one(entry, args.timeout)
    print("\nheadline figures, beside the raw limits of this machine measured in the same run:")
    print(f"{'table':<13} {'figure':<44} {'value':>14}   limits")
    for name, bench in benches.items():
        bound = ", ".join(f"{key} {limits[key]}" for key in bench["limits"])
        if bench["returncode"] != 0:
            print(f"{name:<13} {'FAILED (exit ' + str(bench['returncode']) + ')':<44} {'':>14}   {bound}")
        for key, value in bench["figures"].items():
            print(f"{name:<13} {key:<44} {value:>14.6g}   {bound}")
    if args.json:
        print(json.dumps({"limits": limits, "benches": benches}))
    return 0 if all(bench["returncode"] == 0 for bench in benches.values()) else 1
