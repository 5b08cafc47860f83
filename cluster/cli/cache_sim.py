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

``validate`` replays a slice of the conversation trace against a live `v41 serve`, then
the simulator on the same rows, and compares the hit rates per tier and turn by turn
(:mod:`cluster.lab.validate`). ``report`` runs the standard experiments
(:mod:`cluster.lab.report`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TRACES = {"conversation": "CONVERSATION_TRACE", "synthetic": "SYNTHETIC_TRACE"}


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
    run.add_argument("--tenants", default=None, metavar="NAME=SHARE:RETENTION,...",
                     help="a tenant mix (scale mode): each tenant's share of the sessions and the retention it asks "
                     "(in_memory, 24h, 72h), e.g. acme=0.6:72h,globex=0.3:24h,hooli=0.1:in_memory")
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
    if args.tenants is not None:
        from cluster.lab.sim_config import TenantShare

        try:
            TenantShare.parse(args.tenants)
        except ValueError as error:
            raise UserError(str(error)) from None
        if args.mode != "scale" or args.requests_table:
            raise UserError("--tenants runs in scale mode, without --requests-table")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    shrink = args.shrink if args.shrink is not None else (1000 if args.mode == "exact" else 1)
    fields = {"ram_bytes": int(args.ram_gb * 2**30), "ssd_bytes": None if args.ssd_tb is None else int(args.ssd_tb * 1e12),
              "chunk_retention_hours": args.retention_hours, "window_ttl_minutes": args.window_ttl_min,
              "mode": args.mode, "shrink": shrink, "hours": args.hours,
              "model": str(args.model) if args.model else None, "tenants": args.tenants}
    checkpoints = None if args.no_checkpoint or args.requests_table else str(args.checkpoint_dir)
    tables = {policy: str(args.out / f"requests-{policy}.parquet") if args.requests_table else None
              for policy in policies}
    from cluster.lab.policy_processes import in_policy_processes

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
    for policy, r in report["policies"].items():
        if r.get("tenants"):
            print(f"\n{policy}, by tenant:\n{'tenant':<12} {'share':>6} {'keeps':>9} {'requests':>10} {'hit RAM':>8} "
                  f"{'hit SSD':>8} {'hit':>7} {'written':>10} {'in RAM':>10} {'on SSD':>10}")
            for t in r["tenants"]:
                rates, totals, held = t["rates"], t["totals"], t["held_bytes"]
                written = totals["chunk_bytes_written"] + totals["window_bytes_written"]
                print(f"{t['name']:<12} {t['share']:>6.2f} {t['retention']:>9} {totals['requests']:>10,} "
                      f"{rates['hit_rate_ram']:>8.3f} {rates['hit_rate_ssd']:>8.3f} {rates['hit_rate']:>7.3f} "
                      f"{written / 1e9:>8.1f}GB {held['ram'] / 1e9:>8.1f}GB {held['ssd'] / 1e9:>8.1f}GB")


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


def validate(args: argparse.Namespace) -> int:
    from cluster import UserError
    from cluster.lab.validate import Slice
    from cluster.lab.validate import validate as compare
    from cluster.serving.local import default_model

    model = args.model or default_model()
    if not (model / "config.json").exists():
        raise UserError(f"no checkpoint at {model}")
    for name in ("conversations", "speedup", "max_prompt_tokens", "max_tokens", "concurrency", "minutes", "ram_mb"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    report = compare(model, Slice(args.conversations, args.minutes, args.speedup, args.max_prompt_tokens,
                                  args.max_tokens, args.concurrency, args.ram_mb, restart=not args.no_restart))
    live, simulated, diffs = report["live"], report["simulated"], report["abs_diff"]
    restarted_s = report["restart_at_s"]
    print(f"v41 cache-sim validate: {report['requests']} requests of {args.conversations} conversations "
          f"({report['prompt_tokens']:,} prompt tokens), replayed in {report['replay_s']} s"
          + ("" if restarted_s is None else f", the store restarted at {restarted_s:.1f} s"))
    print(f"{'hit rate':<10} {'live':>7} {'sim':>7} {'diff':>7}")
    for key, label in (("hit_rate_ram", "RAM"), ("hit_rate_ssd", "SSD"), ("hit_rate", "total")):
        print(f"{label:<10} {live[key]:>7.3f} {simulated[key]:>7.3f} {diffs[key]:>7.3f}")
    print(f"max |live - simulated| = {report['max_abs_hit_rate_diff']:.3f}; RAM evictions: live "
          f"{report['evictions']['live_ram']}, simulated {report['evictions']['simulated_ram']}")
    turns = report["turns"]
    differing = [(i, t) for i, t in enumerate(turns) if t["cached_live"] != t["cached_sim_ram"] + t["cached_sim_ssd"]]
    print(f"turns whose cached tokens differ: {len(differing)} of {len(turns)}")
    for i, t in differing:
        print(f"  #{i}: sent {t['sent_s']:.3f} s, looked up {t['lookup_s']:.3f} s, stored {t['stored_s']:.3f} s; "
              f"cached live {t['cached_live']}, simulated {t['cached_sim_ram']} RAM + {t['cached_sim_ssd']} SSD")
    if args.json:
        print(json.dumps(report))
    return 0
