"""`v41 bench agents --hosts N`: the agent workload across namespace hosts, over shaped links.

The cluster is :class:`cluster.hosts_app.HostsApp` (root only): a head host (Redis, the
Ray head, the router) and ``--hosts`` worker hosts, each a raylet with one prefill and
one decoder place, every link shaped to ``--link-gbit`` (a list: each speed is a run of
its own). Per link speed and policy the hosts and the app are made afresh (empty
stores and index), and the workload of `v41 bench agents` runs from a client on the
head host, so every cache moved between replicas, every handoff and every token
crosses a shaped link. Beside the bench's own numbers it reports the bytes that
crossed the links (the switch ports' counters) and the cache bytes the replicas read
from other hosts' stores (``x-v41-moved-bytes``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from cluster.bench import agent_workload
from cluster.hosts import Hosts
from cluster.hosts_app import HostsApp

# The client, run inside the head host: the workload, then the stores' hits by tier.
_CLIENT = """
import argparse, asyncio, json, sys
from dataclasses import asdict
import ray
from actors.store import tier_totals
from cluster.bench import agent_workload
url, model, head = sys.argv[1], sys.argv[2], sys.argv[3]
args = argparse.Namespace(**json.loads(sys.argv[4]))
turns, elapsed = asyncio.run(agent_workload.run_workload(url, model, args))
ray.init(address=head, logging_level="ERROR")
hits = {tier: row["hits"] for tier, row in tier_totals().items()}
print(json.dumps({"turns": [None if t is None else asdict(t) for t in turns], "elapsed": elapsed, "hits": hits}))
"""


def link_bytes(cluster: Hosts) -> int:
    """Bytes through every host's switch port, both ways, so far."""
    total = 0
    for host in cluster.hosts:
        shown = subprocess.run(["ip", "-n", cluster.switch, "-j", "-s", "link", "show", f"p{host.index}"],
                               capture_output=True, text=True, check=True).stdout
        stats = json.loads(shown)[0]["stats64"]
        total += stats["rx"]["bytes"] + stats["tx"]["bytes"]
    return total // 2  # (a byte between two hosts passes two ports)


def _config(model: Path, policy: str, args) -> str:
    return (f"model: {model}\nrouting: {policy}\nprefill_replicas: {args.hosts}\ndecoder_replicas: {args.hosts}\n"
            "prefill_resources: {prefill_host: 1}\ndecoder_resources: {decoder_host: 1}\n"
            f"speculation: '{args.speculation}'\nmax_model_len: {args.depth + 8192}\n"
            "ssd_dir: {run}/ssd-{node}\ncompiled_step: false\n")


def _one(model: Path, name: str, policy: str, gbit: float, args) -> dict:
    """One policy at one link speed, on hosts made for it."""
    with Hosts(args.hosts, link_gbit=gbit) as cluster:
        app = HostsApp(cluster, _config(model, policy, args), head_resources={},
                       worker_resources=[{"prefill_host": 1, "decoder_host": 1}] * args.hosts)
        try:
            app.start(timeout_s=900)
            before = link_bytes(cluster)
            workload = {key: getattr(args, key) for key in ("sessions", "seconds", "depth", "max_tokens", "seed")}
            done = app.client(cluster.head, _CLIENT, name, f"{cluster.head.address}:6379", json.dumps(workload),
                              timeout=args.seconds + 1800)
            if done.returncode != 0:
                raise RuntimeError(f"the client failed:\n{done.stderr[-3000:]}")
            crossed = link_bytes(cluster) - before
        finally:
            app.stop()
    out = json.loads(done.stdout.strip().splitlines()[-1])
    turns = [None if t is None else agent_workload.Turn(**t) for t in out["turns"]]
    summary = agent_workload.turn_summary(turns, out["elapsed"], out["hits"])
    summary["bytes_moved_between_hosts"] = sum(t.moved_bytes for t in turns if t is not None)
    summary["link_bytes"] = crossed
    return summary


def run(args: argparse.Namespace, model: Path, name: str, policies: list[str]) -> dict:
    """Every link speed of ``--link-gbit`` x every policy: {gbit: {policy: summary}}."""
    speeds = [float(x) for x in str(args.link_gbit).split(",") if x.strip()]
    runs = {}
    for gbit in speeds:
        runs[gbit] = {policy: _one(model, name, policy, gbit, args) for policy in policies}
        print(f"link {gbit:g} Gbit/s: done", file=sys.stderr)
    return runs


def report(args, model: Path, runs: dict) -> dict:
    """Print each link speed's table; the JSON summary (the first speed's headline
    numbers at the top, every speed's under ``links``)."""
    summary: dict = {"hosts": args.hosts, "links": {}}
    for gbit, results in runs.items():
        print(f"\n== {args.hosts} hosts, links of {gbit:g} Gbit/s ==")
        line = agent_workload.print_tables(model, args, results, f"{args.hosts} hosts over {gbit:g} Gbit/s links")
        for policy, row in results.items():
            print(f"{policy:<12} cache bytes read across hosts {row['bytes_moved_between_hosts'] / 1e6:.2f} MB, "
                  f"through the links {row['link_bytes'] / 1e6:.1f} MB; returning turns whose cache was elsewhere: "
                  f"{row['turns_moved']} moved it, {row['turns_recomputed']} encoded it again")
        first = next(iter(results.values()))
        line["bytes_moved_between_hosts"] = first["bytes_moved_between_hosts"]
        line["link_bytes"] = first["link_bytes"]
        summary["links"][f"{gbit:g}"] = line
    headline = next(iter(summary["links"].values()))
    for key in ("affinity_over_pow2_ttft_p50", "bytes_moved_between_hosts", "immediate_turn_cached_fraction"):
        if key in headline:
            summary[key] = headline[key]
    return summary

