"""`v41 bench agents`: concurrent synthetic agent sessions on a cluster of several raylets,
with each routing policy in turn on the same workload.

The cluster: ``--raylets`` raylets on this machine (each offers one prefill and one
decoder place: ``--raylets`` replicas per pool), an embedded Redis, the app as `v41
serve` runs it. Per policy (``affinity``, ``pow2``, ``round_robin``: the app's
``routing``) the app is deployed afresh, with empty stores and index, and the same
seeded workload runs for ``--seconds``:

- ``--sessions`` agents at once, sharing a system prompt with tool schemas; each
  starts with a task and a file it read (a few hundred to ~16K tokens: that first,
  cold turn is sent before the clock starts and not measured), then loops: answer
  (``--max-tokens``), a gap of 0 (40% of turns) to 2 s, a tool result of 50-500
  tokens appended, the whole history sent again, until ``--depth`` tokens.

Per turn it records the prompt's depth, TTFT, the cached tokens against what the
previous turn left computed (prompt + answer - 1), the bytes read from other nodes'
stores (``x-v41-moved-bytes``), where the conversation was found
(``x-v41-prefilled-by``: "resident" when the decoder replica that answered the last
turn still kept it, actors/resident.py); per policy, the stores' hits by tier.
Reported: TTFT p50/p99 and the cached fraction by depth (1K, 2K, 4K, 8K, 16K),
re-prefilled tokens, the cached fraction of the turns sent with no pause, the
fraction of returning turns resumed from a kept conversation, decode tokens/s, bytes
moved between nodes, and the affinity / power-of-two TTFT p50. The sessions, the
records and the tables are :mod:`cluster.bench.agent_workload`; ``--hosts N`` runs the
same across namespace hosts over shaped links (:mod:`cluster.bench.agents_hosts`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

from cluster.bench.agent_workload import print_tables, run_workload, turn_summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the shipped small one)")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=90.0, help="workload time per policy")
    parser.add_argument("--policies", default="affinity,pow2,round_robin")
    parser.add_argument("--raylets", type=int, default=2, help="raylets on this machine (replicas per pool)")
    parser.add_argument("--hosts", type=int, default=0,
                        help="run across this many namespace hosts (root), each a prefill and a decoder place, "
                             "instead of raylets sharing this machine's address (cluster/hosts.py)")
    parser.add_argument("--link-gbit", default="1", help="with --hosts: each link's bandwidth, a list for several runs")
    parser.add_argument("--depth", type=int, default=17000, help="a session stops past this many tokens")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--speculation", choices=("scheduled", "fixed", "off"), default="off")
    parser.add_argument("--seed", type=int, default=0)



def _drop_stores(namespace: str = "v41") -> None:
    """Kill every node's store actor: the next policy starts with empty caches."""
    import ray

    from actors.store import store_actors

    for store in store_actors(namespace).values():
        ray.kill(store, no_restart=True)


def run(args: argparse.Namespace) -> int:
    import ray
    from ray.cluster_utils import Cluster

    from actors.store import tier_totals
    from cluster import UserError
    from cluster.serving.local import default_model, local_app, use_serve_environment
    from actors.config import AppConfig
    from storage.redis_server import free_port

    model = args.model or default_model()
    if not (model / "config.json").exists():
        raise UserError(f"no checkpoint at {model}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for policy in policies:
        AppConfig.from_args({"model": str(model), "routing": policy})  # a mistake is one line, before anything starts
    name = AppConfig.from_args({"model": str(model)}).model_name
    if args.hosts:
        from cluster import hosts
        from cluster.bench import agents_hosts

        if hosts.available() is not None:
            raise UserError(f"--hosts: {hosts.available()}")

        summary = agents_hosts.report(args, model, agents_hosts.run(args, model, name, policies))
        if args.json:
            print(json.dumps(summary))
        return 0
    port = free_port()
    use_serve_environment(port)  # before the raylets start: every Ray process runs with it
    places = {"prefill_host": 1, "decoder_host": 1}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 3, "resources": places, "object_store_memory": 256 << 20, "include_dashboard": False})
    cache_root = tempfile.mkdtemp(prefix="v41-bench-agents-")
    results = {}
    try:
        for _ in range(args.raylets - 1):
            cluster.add_node(num_cpus=3, resources=places, object_store_memory=256 << 20)
        cluster.wait_for_nodes()
        for policy in policies:
            app_args = {"model": str(model), "routing": policy, "prefill_replicas": args.raylets,
                        "decoder_replicas": args.raylets, "prefill_resources": {"prefill_host": 1},
                        "decoder_resources": {"decoder_host": 1}, "speculation": args.speculation,
                        "max_model_len": args.depth + 8192, "ssd_dir": f"{cache_root}/{policy}/{{node}}",
                        "compiled_step": False}  # (the step is `bench serve`'s business: eager here)
            with local_app(app_args, port=port, address=cluster.address):
                turns, elapsed = asyncio.run(run_workload(f"http://127.0.0.1:{port}", name, args))
                hits = {tier: row["hits"] for tier, row in tier_totals().items()}
                _drop_stores()
            results[policy] = turn_summary(turns, elapsed, hits)
            ray.shutdown()
    finally:
        cluster.shutdown()
        shutil.rmtree(cache_root, ignore_errors=True)
    summary = print_tables(model, args, results, f"{args.raylets} raylets")
    if args.json:
        print(json.dumps(summary))
    return 0
