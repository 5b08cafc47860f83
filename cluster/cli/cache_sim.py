"""`v41 cache-sim`: the retention lab (``cluster/lab``).

    v41 cache-sim run --trace conversation --stretch 72            # the Mooncake chat trace over 72 h
    v41 cache-sim run --profile agent --sessions 100000 --hours 96  # synthetic agent sessions
    v41 cache-sim run --profile my-workload.yaml --json
    v41 cache-sim validate --json                                   # simulator vs a live v41 serve

``run`` replays a workload through the real store's policy on a virtual clock, once per
storage policy (``--policies v41,v4``: V4.1 keeps window states in RAM for minutes; V4
persisted them to SSD with the chunks), the policies in parallel processes, and prints
per policy the hit rate per tier (token-weighted; request-weighted beside it), the
window-state hit rate, how often the encoder replays, the bytes stored per tier, and the
ratio of what V4.1 stores to what V4 stores.

``validate`` starts a `v41 serve` (the shipped small model, chunks of 128 tokens as the
simulator's, an embedded Redis, the SSD tier in a temporary directory), replays a slice
of the conversation trace against it (:mod:`cluster.lab.replay`; whole
conversations, time compressed, prompts cut), restarts the node's store halfway (RAM
lost, the SSD tier reopened: the second half's hits on earlier conversations come from
SSD), then runs the simulator in exact mode on the same rows, with the turn ends the
cluster measured and the restart at the same time, and compares the hit rates per tier
(token-weighted). The cluster's tiers: the cached tokens its answers report, of which
the chunks its store read from SSD (each read there once, then promoted) came from SSD.
"""

from __future__ import annotations

import argparse
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

TRACES = {"conversation": "CONVERSATION_TRACE", "synthetic": "SYNTHETIC_TRACE"}
# A simulation's processes keep their heap on transparent huge pages (see in_policy_processes).
HUGE_PAGE_ENV = {"PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
_kept: list = []  # what a policy process holds until it exits (see _policy_process)


def in_policy_processes(calls: list[tuple], native: Path | None = None) -> list[dict]:
    """``_simulate(*call)`` for each call, each in a process of its own, all at once;
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
        outcome = (True, _simulate(*call))
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = sub.add_parser("run", help="simulate a workload under the V4.1 and V4 storage policies")
    source = run.add_mutually_exclusive_group()
    source.add_argument("--trace", help="conversation, synthetic (the shipped Mooncake traces) or a JSONL(.gz) path")
    source.add_argument("--profile", help="chat, agent, mixed, or a YAML/JSON file of profile parameters")
    run.add_argument("--sessions", type=int, default=None, help="synthetic sessions (overrides the profile)")
    run.add_argument("--hours", type=float, default=None,
                     help="virtual hours to simulate (synthetic: also the span of session starts)")
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stretch", type=float, default=1.0, help="trace timestamps x this")
    run.add_argument("--tile", type=int, default=1, help="chain this many copies of the trace")
    run.add_argument("--policies", default="v41,v4", help="comma-separated: v41, v4")
    run.add_argument("--ram-gb", type=float, default=200.0, help="host RAM pool (default: 10%% of 2 TB)")
    run.add_argument("--ssd-tb", type=float, default=None, help="SSD capacity (default: unbounded)")
    run.add_argument("--retention-hours", type=float, default=72.0)
    run.add_argument("--window-ttl-min", type=float, default=30.0)
    run.add_argument("--mode", choices=("scale", "exact"), default="scale",
                     help="scale: sizes only; exact: real files (payloads divided by --shrink)")
    run.add_argument("--shrink", type=int, default=None, help="divide object sizes by this (default 1; exact 1000)")
    run.add_argument("--model", type=Path, default=None, help="config directory the sizes come from "
                     "(default: the released V4.1-Flash config)")
    run.add_argument("--checkpoint-dir", type=Path, default=Path(".v41/cache-sim"),
                     help="scale mode: save each policy's state here every two minutes or more; the same command "
                          "run again resumes from it (removed when a run ends)")
    run.add_argument("--no-checkpoint", action="store_true", help="do not save or resume")
    run.add_argument("--out", type=Path, default=None, help="write summary.json and samples.parquet (the tiers "
                     "each virtual hour, per policy) here")
    run.add_argument("--requests-table", action="store_true",
                     help="with --out: also requests-POLICY.parquet, one row per request (no checkpoints then)")
    run.add_argument("--no-compile", action="store_true", help="scale mode: run the simulator as plain Python, "
                     "not compiled with mypyc (~1.8x slower; the same counters)")
    run.add_argument("--json", action="store_true", help="print one JSON object on the last line")

    report = sub.add_parser("report", help="the standard experiments: sweeps, plots, tables and a report")
    report.add_argument("--out", type=Path, default=Path("cache-sim-report"), help="directory for the outputs")
    report.add_argument("--sessions", type=int, default=10000, help="agent sessions of the default runs")
    report.add_argument("--hours", type=float, default=96.0, help="virtual hours of the agent workload")
    report.add_argument("--workers", type=int, default=2, help="simulations in parallel")
    report.add_argument("--json", action="store_true", help="print one JSON object on the last line")

    check = sub.add_parser("validate", help="replay a trace slice against a live v41 serve and compare with the "
                           "simulator")
    check.add_argument("--model", type=Path, default=None, help="checkpoint to serve (default: the shipped small one)")
    check.add_argument("--conversations", type=int, default=16, help="conversations taken from the trace")
    check.add_argument("--minutes", type=float, default=20.0, help="trace minutes they are taken from")
    check.add_argument("--speedup", type=float, default=10.0, help="replay the trace this many times faster")
    check.add_argument("--max-prompt-tokens", type=int, default=4000, help="prompts cut to this length")
    check.add_argument("--max-tokens", type=int, default=4, help="answers cut to this length")
    check.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    check.add_argument("--ram-mb", type=float, default=1024.0, help="the node's RAM pool (small: RAM evicts)")
    check.add_argument("--no-restart", action="store_true", help="do not restart the store halfway")
    check.add_argument("--json", action="store_true", help="print one JSON object on the last line")


def _workload(args: argparse.Namespace):
    """A factory of the request stream (each policy's process builds its own)."""
    from cluster.lab import workload

    if args.profile is None:
        name = args.trace or "conversation"
        path = getattr(workload, TRACES[name]) if name in TRACES else Path(name)
        if not path.exists():
            raise FileNotFoundError(f"no trace at {path}")
        return ("trace", str(path), args.stretch, args.tile)
    overrides = {k: v for k, v in (("sessions", args.sessions), ("hours", args.hours), ("seed", args.seed))
                 if v is not None}
    if args.profile in workload.PROFILES:
        profile = workload.Profile.named(args.profile, **overrides)
    else:
        profile = workload.Profile.from_file(args.profile, **overrides)
    return ("synthetic", profile.model_dump())


def _requests(spec):
    from cluster.lab import workload

    if spec[0] == "trace":
        return workload.mooncake(spec[1], stretch=spec[2], tile=spec[3])
    return workload.synthetic(workload.Profile.model_validate(spec[1]))


def _simulate(policy: str, config_fields: dict, spec, show_progress: bool, checkpoint_dir: str | None = None,
              table_path: str | None = None) -> dict:
    import hashlib

    import torch

    from cluster.lab import sizes as sizes_module
    from cluster.lab.simulate import SimConfig, Simulator

    torch.set_num_threads(1)
    model = config_fields.pop("model")
    sizes = sizes_module.v4_flash() if policy == "v4" else (
        sizes_module.from_config(model) if model else sizes_module.from_config())
    config = SimConfig(sizes, **config_fields)
    started = time.time()

    first: list[float] = []  # the virtual hour this process started from (a resumed run's is not 0)

    def progress(now_s: float, requests: int) -> None:
        if not show_progress:
            return
        first[:] = first or [now_s]
        elapsed = time.time() - started
        line = f"\r{policy}: {now_s / 3600:6.1f} virtual h | {requests:,} requests | {elapsed:6.0f} s"
        if config.hours:  # a bar, and the time left at this pace
            done = min(1.0, now_s / (config.hours * 3600))
            pace = (now_s - first[0]) / max(1e-9, elapsed)
            left = f"~{(config.hours * 3600 - now_s) / pace:5.0f} s left" if pace > 0 else "  ? s left"
            line = f"\r{policy}: [{'#' * int(30 * done):<30}] {done:4.0%} | {requests:,} requests | {elapsed:5.0f} s, {left}"
        print(line, end="", file=sys.stderr, flush=True)

    checkpoint = None
    if checkpoint_dir is not None and config.mode == "scale":  # one file per policy, workload and settings
        tag = hashlib.sha1(json.dumps([policy, config_fields, model, spec], sort_keys=True).encode()).hexdigest()
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        checkpoint = Path(checkpoint_dir) / f"{policy}-{tag[:16]}.npz"
        if checkpoint.exists() and show_progress:
            print(f"resuming from {checkpoint}", file=sys.stderr)
    from cluster.lab.simulate import RequestTable

    table = RequestTable(Path(table_path)) if table_path else None
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
    from cluster.lab.native import active

    return {"policy": policy, "compiled": active(), "sizes": sizes.as_dict(), "rates": result.rates,
            "totals": asdict(result.totals),
            "store": result.store, "virtual_hours": result.virtual_s / 3600, "wall_s": result.wall_s,
            "mean_stored_bytes": sum(stored) / max(1, len(stored)),
            "peak_stored_bytes": max(stored, default=0),
            "samples": [asdict(s) for s in samples]}


def run(args: argparse.Namespace) -> int:
    if args.action == "validate":
        return validate(args)
    if args.action == "report":
        return make_report(args)
    from cluster import UserError

    started = time.time()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or set(policies) - {"v41", "v4"}:
        raise UserError("--policies takes v41 and/or v4")
    try:
        spec = _workload(args)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise UserError(str(error)) from None
    if args.requests_table and args.out is None:
        raise UserError("--requests-table needs --out")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    shrink = args.shrink if args.shrink is not None else (1000 if args.mode == "exact" else 1)
    fields = {"ram_bytes": int(args.ram_gb * 2**30), "ssd_bytes": None if args.ssd_tb is None else int(args.ssd_tb * 1e12),
              "chunk_retention_hours": args.retention_hours, "window_ttl_minutes": args.window_ttl_min,
              "mode": args.mode, "shrink": shrink, "hours": args.hours,
              "model": str(args.model) if args.model else None}
    checkpoints = None if args.no_checkpoint or args.requests_table else str(args.checkpoint_dir)
    tables = {policy: str(args.out / f"requests-{policy}.parquet") if args.requests_table else None
              for policy in policies}
    native = None
    if args.mode == "scale" and not args.no_compile:
        from cluster.lab.native import build

        native = build(log=sys.stderr)
        if not native.ok:
            print(f"running the simulator as plain Python (~1.8x slower): {native.reason}", file=sys.stderr)
    results = dict(zip(policies, in_policy_processes(
        [(policy, dict(fields), spec, i == 0, checkpoints, tables[policy]) for i, policy in enumerate(policies)],
        native.directory if native is not None else None)))
    first = next(iter(results.values()))
    report = {"workload": spec[0] if spec[0] == "trace" else "synthetic",
              "source": spec[1] if spec[0] == "trace" else spec[1]["name"],
              "sessions": spec[1]["sessions"] if spec[0] == "synthetic" else None,
              "requests": first["totals"]["requests"], "virtual_hours": round(first["virtual_hours"], 2),
              "wall_s": round(time.time() - started, 1), "mode": args.mode, "shrink": shrink,
              "compiled": all(r["compiled"] for r in results.values()),
              "compile_s": round(native.built_s, 1) if native is not None else 0.0,
              "policies": {policy: {key: value for key, value in r.items() if key != "samples"}
                           for policy, r in results.items()}}
    if {"v41", "v4"} <= set(results):
        report["stored_bytes_v41_over_v4"] = round(results["v41"]["mean_stored_bytes"] /
                                                   max(1.0, results["v4"]["mean_stored_bytes"]), 4)
    if args.out is not None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([
            {"policy": policy, "time_h": s["time_s"] / 3600, "requests": s["requests"],
             **{f"objects_{t}": n for t, n in s["objects"].items()}, **{f"bytes_{t}": b for t, b in s["bytes"].items()},
             "chunk_bytes_written": s["chunk_bytes_written"], "window_bytes_written": s["window_bytes_written"]}
            for policy, r in results.items() for s in r["samples"]]), args.out / "samples.parquet")
        (args.out / "summary.json").write_text(json.dumps(report, indent=1) + "\n")
    _print_table(report)
    if args.json:
        print(json.dumps(report))
    return 0


def _print_table(report: dict) -> None:
    print(f"v41 cache-sim run: {report['workload']} {report['source']}, {report['requests']:,} requests, "
          f"{report['virtual_hours']} virtual h, {report['wall_s']} s ({report['mode']} mode"
          f"{', compiled' if report['compiled'] else ''})")
    print(f"{'policy':<7} {'hit RAM':>8} {'hit SSD':>8} {'hit':>7} {'req RAM':>8} {'req SSD':>8} {'window':>7} "
          f"{'replay':>7} {'mean stored':>12} {'peak stored':>12}")
    for policy, r in report["policies"].items():
        rates = r["rates"]
        print(f"{policy:<7} {rates['hit_rate_ram']:>8.3f} {rates['hit_rate_ssd']:>8.3f} {rates['hit_rate']:>7.3f} "
              f"{rates['request_hit_rate_ram']:>8.3f} {rates['request_hit_rate_ssd']:>8.3f} "
              f"{rates['window_hit_rate']:>7.3f} {rates['replay_rate']:>7.3f} "
              f"{r['mean_stored_bytes'] / 1e9:>10.1f}GB {r['peak_stored_bytes'] / 1e9:>10.1f}GB")
    if "stored_bytes_v41_over_v4" in report:
        print(f"stored bytes, V4.1 / V4 (time mean): {report['stored_bytes_v41_over_v4']:.3f}")


# ---------------------------------------------------------------------- report


def make_report(args: argparse.Namespace) -> int:
    from cluster.lab.report import run_all
    from cluster import UserError

    if args.sessions < 4 or args.hours <= 0 or args.workers < 1:
        raise UserError("--sessions must be at least 4, --hours and --workers positive")

    def progress(done: int, total: int) -> None:
        print(f"\r{done}/{total} simulations", end="", file=sys.stderr, flush=True)

    summary = run_all(args.out, args.sessions, args.hours, workers=args.workers, progress=progress)
    print(file=sys.stderr)
    print(f"v41 cache-sim report: {summary['runs']} simulations in {summary['wall_s']} s -> {args.out}/report.md")
    for workload, w in summary["workloads"].items():
        for policy, p in w["policies"].items():
            print(f"{workload:<13} {policy:<4} hit {p['hit_rate']:.3f} (RAM {p['hit_rate_ram']:.3f}, SSD "
                  f"{p['hit_rate_ssd']:.3f})  window {p['window_hit_rate']:.3f}  peak SSD {p['peak_ssd_tb']:.2f} TB  "
                  f"DWPD {p['dwpd']:.2f}")
        print(f"{workload:<13} stored bytes V4.1 / V4: {w['stored_bytes_v41_over_v4']:.3f}")
    if args.json:
        print(json.dumps(summary))
    return 0


# ---------------------------------------------------------------------- validate

_TIERS = ("ram", "ssd")


def _restart_store() -> None:
    """Kill the node's store actor (Ray restarts it on its SSD slot) and wait until the
    new process answers (the old one may still answer a call sent just after the kill)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    from actors.store import store_actors

    (store,) = store_actors().values()
    ray.get(store.flush.remote())  # what the first half wrote is on the SSD (as the simulator's is)
    old = ray.get(store.pid.remote())
    ray.kill(store, no_restart=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if ray.get(store.pid.remote(), timeout=5) != old:
                return
        except (RayError, GetTimeoutError):  # still restarting
            pass
        time.sleep(0.2)
    raise RuntimeError("the store actor did not come back within 120 s")


def _live(sent, ssd_hits: int, chunk_tokens: int) -> dict[str, float]:
    prompt = sum(s.prompt_tokens for s in sent)
    cached = sum(s.cached_tokens for s in sent)
    ssd = ssd_hits * chunk_tokens
    return {"hit_rate_ram": (cached - ssd) / max(1, prompt), "hit_rate_ssd": ssd / max(1, prompt),
            "hit_rate": cached / max(1, prompt)}


def validate(args: argparse.Namespace) -> int:
    import asyncio
    import shutil
    import tempfile

    import pyarrow.parquet as pq

    from actors.store import tier_totals
    from cluster.lab import replay, workload
    from cluster.lab import sizes as sizes_module
    from cluster.lab.simulate import RequestTable, SimConfig, Simulator
    from cluster import UserError
    from cluster.serving.local import default_model, local_app
    from actors.config import AppConfig
    from model.config import ModelConfig
    from storage.redis_server import free_port

    started = time.time()
    model = args.model or default_model()
    if not (model / "config.json").exists():
        raise UserError(f"no checkpoint at {model}")
    for name in ("conversations", "speedup", "max_prompt_tokens", "max_tokens", "concurrency", "minutes", "ram_mb"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    rows = replay.trace_slice(workload.read_trace(workload.CONVERSATION_TRACE), args.conversations, args.minutes,
                              args.max_prompt_tokens, args.max_tokens)
    if len(rows) < 2:
        raise UserError("the slice holds fewer than two requests: take more --conversations or --minutes")
    vocab = ModelConfig.from_dict(json.loads((model / "config.json").read_text())).text.vocab_size
    chunk_tokens = workload.CHUNK_TOKENS
    ram_bytes = int(args.ram_mb * (1 << 20))
    app_args = {"model": str(model), "chunk_tokens": chunk_tokens, "ram_capacity_bytes": ram_bytes,
                "max_model_len": args.max_prompt_tokens + args.max_tokens + 64, "speculation": "off"}
    restart_at = None if args.no_restart else len(rows) // 2
    cache_dir = tempfile.mkdtemp(prefix="v41-cache-sim-validate-")
    app_args["ssd_dir"] = cache_dir + "/{node}"
    port = free_port()
    before: dict[str, dict] = {}

    async def restart() -> None:
        before.update(tier_totals())  # a restarted store counts from zero
        await asyncio.to_thread(_restart_store)

    try:
        with local_app(app_args, port=port):
            name = AppConfig.from_args({"model": str(model)}).model_name
            sent, restarted_s = asyncio.run(replay.replay(f"http://127.0.0.1:{port}", name, rows, vocab,
                                                          args.speedup, args.concurrency, restart_at, restart))
            after = tier_totals()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    failed = [s for s in sent if s.status != 200]
    if failed:
        raise UserError(f"{len(failed)} of {len(sent)} replayed requests failed, e.g. {failed[0].error}")
    ssd_hits = before.get("ssd", {}).get("hits", 0) + after.get("ssd", {}).get("hits", 0)
    live = _live(sent, ssd_hits, chunk_tokens)

    # The simulator on the same rows, at the times the cluster looked them up and stored them.
    looked = [s.sent_s if s.lookup_s is None else s.lookup_s for s in sent]
    stored = [s.done_s if s.stored_s is None else s.stored_s for s in sent]
    timed = [dict(row, timestamp=at * 1000.0) for row, at in zip(rows, looked)]
    order = sorted(range(len(sent)), key=looked.__getitem__)  # the simulator's arrival order
    unordered = list(workload.trace_requests(timed, done_s=stored))
    requests = [unordered[i] for i in order]
    config = SimConfig(sizes_module.from_config(model, chunk_tokens), ram_bytes=ram_bytes, mode="exact", shrink=1,
                       extents=False)  # one object per chunk, as the store keeps them
    table_dir = tempfile.mkdtemp(prefix="v41-cache-sim-validate-")
    try:
        table = RequestTable(Path(table_dir) / "requests.parquet")
        with Simulator(config) as simulator:
            result = simulator.run(requests, restarts=[] if restarted_s is None else [restarted_s], table=table)
            simulated_evictions = result.store["tiers"]["ram"]["evictions"] + sum(
                stats.tiers["ram"].evictions for stats in simulator.earlier_stores)
        table.close()
        outcomes = pq.read_table(table.path, columns=["hit_tokens_ram", "hit_tokens_ssd"]).to_pylist()
    finally:
        shutil.rmtree(table_dir, ignore_errors=True)
    # Each turn, in the order sent: what the cluster found against what the simulator found.
    turns = [None] * len(sent)
    for index, outcome in zip(order, outcomes):
        s = sent[index]
        turns[index] = {"sent_s": round(s.sent_s, 3), "lookup_s": round(looked[index], 3),
                        "stored_s": round(stored[index], 3), "prompt_tokens": s.prompt_tokens,
                        "cached_live": s.cached_tokens, "cached_sim_ram": outcome["hit_tokens_ram"],
                        "cached_sim_ssd": outcome["hit_tokens_ssd"]}
    simulated = {key: result.rates[key] for key in ("hit_rate_ram", "hit_rate_ssd", "hit_rate")}
    diffs = {key: abs(live[key] - simulated[key]) for key in simulated}
    report = {"requests": len(sent), "conversations": args.conversations, "prompt_tokens": sum(s.prompt_tokens
              for s in sent), "restart_at_s": restarted_s, "replay_s": round(max(s.done_s for s in sent), 1),
              "live": {k: round(v, 4) for k, v in live.items()}, "simulated": {k: round(v, 4) for k, v in
                                                                               simulated.items()},
              "abs_diff": {k: round(v, 4) for k, v in diffs.items()},
              "max_abs_hit_rate_diff": round(max(diffs.values()), 4), "ram_mb": args.ram_mb,
              "evictions": {"live_ram": before.get("ram", {}).get("evictions", 0) + after.get("ram", {}).get("evictions", 0),
                            "simulated_ram": simulated_evictions},
              "wall_s": round(time.time() - started, 1), "turns": turns}
    print(f"v41 cache-sim validate: {report['requests']} requests of {args.conversations} conversations "
          f"({report['prompt_tokens']:,} prompt tokens), replayed in {report['replay_s']} s"
          + ("" if restarted_s is None else f", the store restarted at {restarted_s:.1f} s"))
    print(f"{'hit rate':<10} {'live':>7} {'sim':>7} {'diff':>7}")
    for key, label in (("hit_rate_ram", "RAM"), ("hit_rate_ssd", "SSD"), ("hit_rate", "total")):
        print(f"{label:<10} {live[key]:>7.3f} {simulated[key]:>7.3f} {diffs[key]:>7.3f}")
    print(f"max |live - simulated| = {report['max_abs_hit_rate_diff']:.3f}; RAM evictions: live "
          f"{report['evictions']['live_ram']}, simulated {report['evictions']['simulated_ram']}")
    differing = [(i, t) for i, t in enumerate(turns) if t["cached_live"] != t["cached_sim_ram"] + t["cached_sim_ssd"]]
    print(f"turns whose cached tokens differ: {len(differing)} of {len(turns)}")
    for i, t in differing:
        print(f"  #{i}: sent {t['sent_s']:.3f} s, looked up {t['lookup_s']:.3f} s, stored {t['stored_s']:.3f} s; "
              f"cached live {t['cached_live']}, simulated {t['cached_sim_ram']} RAM + {t['cached_sim_ssd']} SSD")
    if args.json:
        print(json.dumps(report))
    return 0
