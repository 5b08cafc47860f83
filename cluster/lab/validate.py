"""The simulator against a live cluster (``v41 cache-sim validate``).

A `v41 serve` (the checkpoint given, chunks of ``CHUNK_TOKENS`` as the simulator's, an
embedded Redis, the SSD tier in a temporary directory) is sent a slice of the
conversation trace (:mod:`cluster.lab.replay`: whole conversations, time compressed,
prompts cut); the node's store restarts halfway (RAM lost, the SSD tier reopened: the
second half's hits on earlier conversations come from SSD). Then the simulator runs in
exact mode on the same rows, with the turn ends the cluster measured and the restart at
the same time, and the two are compared per tier (token-weighted) and turn by turn. The
cluster's tiers: the cached tokens its answers report, of which the chunks its store read
from SSD (each read there once, then promoted) came from SSD.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster import UserError
from cluster.lab import replay, workload

@dataclass(frozen=True)
class Slice:
    """What is replayed, how fast, and on how small a RAM pool."""

    conversations: int = 16  # taken from the trace
    minutes: float = 20.0  # of the trace they are taken from
    speedup: float = 10.0
    max_prompt_tokens: int = 4000
    max_tokens: int = 4
    concurrency: int = 4
    ram_mb: float = 1024.0
    restart: bool = True  # restart the store halfway


@dataclass
class Live:
    """The replay against the cluster: each request as sent, when the store restarted,
    the store's tier counters before the restart and after the replay."""

    sent: list
    restarted_s: float | None
    before: dict[str, dict] = field(default_factory=dict)
    after: dict[str, dict] = field(default_factory=dict)

    def counter(self, tier: str, name: str) -> int:
        return self.before.get(tier, {}).get(name, 0) + self.after.get(tier, {}).get(name, 0)


def validate(model: Path, settings: Slice) -> dict:
    """Replay, simulate, compare: the report (rates live and simulated, their
    differences, evictions, and every turn's cached tokens both ways)."""
    import json

    from model.config import ModelConfig

    started = time.time()
    rows = replay.trace_slice(workload.read_trace(workload.CONVERSATION_TRACE), settings.conversations,
                              settings.minutes, settings.max_prompt_tokens, settings.max_tokens)
    if len(rows) < 2:
        raise UserError("the slice holds fewer than two requests: take more --conversations or --minutes")
    vocab = ModelConfig.from_dict(json.loads((model / "config.json").read_text())).text.vocab_size
    live = _replay_live(model, rows, vocab, settings)
    sent = live.sent
    failed = [s for s in sent if s.status != 200]
    if failed:
        raise UserError(f"{len(failed)} of {len(sent)} replayed requests failed, e.g. {failed[0].error}")
    rates = _live_rates(sent, live.counter("ssd", "hits"), workload.CHUNK_TOKENS)
    simulated, turns, evictions = _simulate_same(model, rows, live, settings)
    diffs = {key: abs(rates[key] - simulated[key]) for key in simulated}
    return {"requests": len(sent), "conversations": settings.conversations,
            "prompt_tokens": sum(s.prompt_tokens for s in sent), "restart_at_s": live.restarted_s,
            "replay_s": round(max(s.done_s for s in sent), 1),
            "live": {k: round(v, 4) for k, v in rates.items()},
            "simulated": {k: round(v, 4) for k, v in simulated.items()},
            "abs_diff": {k: round(v, 4) for k, v in diffs.items()},
            "max_abs_hit_rate_diff": round(max(diffs.values()), 4), "ram_mb": settings.ram_mb,
            "evictions": {"live_ram": live.counter("ram", "evictions"), "simulated_ram": evictions},
            "wall_s": round(time.time() - started, 1), "turns": turns}


def _replay_live(model: Path, rows: list[dict], vocab: int, settings: Slice) -> Live:
    """The rows sent to a `v41 serve` of ``model`` started for the replay (and stopped)."""
    from actors.config import AppConfig
    from actors.store import tier_totals
    from cluster.serving.local import local_app
    from storage.redis_server import free_port

    app_args = {"model": str(model), "chunk_tokens": workload.CHUNK_TOKENS,
                "ram_capacity_bytes": int(settings.ram_mb * (1 << 20)),
                "max_model_len": settings.max_prompt_tokens + settings.max_tokens + 64, "speculation": "off",
                "compiled_step": False}  # (the counters do not depend on the step)
    restart_at = len(rows) // 2 if settings.restart else None
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
                                                          settings.speedup, settings.concurrency, restart_at, restart))
            after = tier_totals()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return Live(sent, restarted_s, before, after)


def _simulate_same(model: Path, rows: list[dict], live: Live, settings: Slice) -> tuple[dict, list[dict], int]:
    """The simulator on the same rows, at the times the cluster looked them up and
    stored them: (its hit rates, each turn both ways in the order sent, RAM evictions)."""
    import pyarrow.parquet as pq

    from cluster.lab import sizes as sizes_module
    from cluster.lab.request_table import RequestTable
    from cluster.lab.sim_config import SimConfig
    from cluster.lab.simulate import Simulator

    sent = live.sent
    looked = [s.sent_s if s.lookup_s is None else s.lookup_s for s in sent]
    stored = [s.done_s if s.stored_s is None else s.stored_s for s in sent]
    timed = [dict(row, timestamp=at * 1000.0) for row, at in zip(rows, looked)]
    order = sorted(range(len(sent)), key=looked.__getitem__)  # the simulator's arrival order
    unordered = list(workload.trace_requests(timed, done_s=stored))
    requests = [unordered[i] for i in order]
    config = SimConfig(sizes_module.from_config(model, workload.CHUNK_TOKENS),
                       ram_bytes=int(settings.ram_mb * (1 << 20)), mode="exact", shrink=1,
                       extents=False)  # one object per chunk, as the store keeps them
    table_dir = tempfile.mkdtemp(prefix="v41-cache-sim-validate-")
    try:
        table = RequestTable(Path(table_dir) / "requests.parquet")
        with Simulator(config) as simulator:
            result = simulator.run(requests, restarts=[] if live.restarted_s is None else [live.restarted_s],
                                   table=table)
            evictions = result.store["tiers"]["ram"]["evictions"] + sum(
                stats.tiers["ram"].evictions for stats in simulator.earlier_stores)
        table.close()
        outcomes = pq.read_table(table.path, columns=["hit_tokens_ram", "hit_tokens_ssd"]).to_pylist()
    finally:
        shutil.rmtree(table_dir, ignore_errors=True)
    # Each turn, in the order sent: what the cluster found against what the simulator found.
    turns: list = [None] * len(sent)
    for index, outcome in zip(order, outcomes):
        s = sent[index]
        turns[index] = {"sent_s": round(s.sent_s, 3), "lookup_s": round(looked[index], 3),
                        "stored_s": round(stored[index], 3), "prompt_tokens": s.prompt_tokens,
                        "cached_live": s.cached_tokens, "cached_sim_ram": outcome["hit_tokens_ram"],
                        "cached_sim_ssd": outcome["hit_tokens_ssd"]}
    return {key: result.rates[key] for key in ("hit_rate_ram", "hit_rate_ssd", "hit_rate")}, turns, evictions


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


def _live_rates(sent, ssd_hits: int, chunk_tokens: int) -> dict[str, float]:
    """The cluster's hit rates per tier (token-weighted): the cached tokens its answers
    report, ``ssd_hits`` chunks of them read from SSD."""
    prompt = sum(s.prompt_tokens for s in sent)
    cached = sum(s.cached_tokens for s in sent)
    ssd = ssd_hits * chunk_tokens
    return {"hit_rate_ram": (cached - ssd) / max(1, prompt), "hit_rate_ssd": ssd / max(1, prompt),
            "hit_rate": cached / max(1, prompt)}
