"""`v41 bench load`: many streaming clients at once, for a while, against `v41 serve`'s app.

Each client sends its next streamed chat request as soon as its last one ended (a
closed loop, as agents do). Reported: requests answered and failed (by status),
tokens/s, and per request the time to first token and the time it waited for a place
in a decoder batch (the router's ``x-v41-queue-ms`` header), p50/p99. With more
clients than batch places, the queue, not errors, takes the load; beyond
``--max-queued`` waiting, requests get 429.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from cluster.bench.sse import sse_chunks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the shipped small one)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-queued", type=int, default=256)


async def _client(session, url: str, model: str, number: int, stop_at: float, max_tokens: int, rows: list,
                  outcomes: Counter) -> None:
    import aiohttp

    n = 0
    while time.monotonic() < stop_at:
        n += 1
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "stream": True,
                "messages": [{"role": "user", "content": f"client {number}, request {n}: def f():"}]}
        started = time.perf_counter()
        try:
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    await response.read()
                    outcomes[str(response.status)] += 1
                    continue
                first, tokens, error = None, 0, False
                async for chunk in sse_chunks(response):
                    if "error" in chunk:
                        error = True
                    elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        tokens += 1
                        first = first or time.perf_counter()
                if error:
                    outcomes["stream error"] += 1
                    continue
                outcomes["200"] += 1
                rows.append((float(response.headers["x-v41-queue-ms"]),
                             1e3 * ((first or time.perf_counter()) - started), tokens))
        except (aiohttp.ClientError, TimeoutError) as failure:
            outcomes[type(failure).__name__] += 1


async def _load(url: str, model: str, args: argparse.Namespace) -> tuple[list, Counter, float]:
    import aiohttp

    rows: list = []
    outcomes: Counter = Counter()
    connector = aiohttp.TCPConnector(limit=0)  # one connection per client
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=connector) as session:
        started = time.monotonic()
        stop_at = started + args.seconds
        await asyncio.gather(*(_client(session, url, model, i, stop_at, args.max_tokens, rows, outcomes)
                               for i in range(args.clients)))
    return rows, outcomes, time.monotonic() - started


def run(args: argparse.Namespace) -> int:
    from cluster import UserError
    from cluster.serving.local import default_model, local_app
    from actors.config import AppConfig
    from storage.redis_server import free_port

    model = args.model or default_model()
    if not (model / "config.json").exists():
        raise UserError(f"no checkpoint at {model}")
    port = free_port()
    cache_dir = tempfile.mkdtemp(prefix="v41-bench-load-")
    app_args = {"model": str(model), "ssd_dir": cache_dir + "/{node}", "max_batch": args.max_batch,
                "max_queued_requests": args.max_queued, "compiled_step": False}  # (admission, not the step)
    name = AppConfig.from_args({"model": str(model)}).model_name
    try:
        with local_app(app_args, port=port):
            rows, outcomes, elapsed = asyncio.run(_load(f"http://127.0.0.1:{port}", name, args))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    waits = np.array([row[0] for row in rows]) if rows else np.zeros(1)
    ttfts = np.array([row[1] for row in rows]) if rows else np.zeros(1)
    tokens = sum(row[2] for row in rows)
    failed = sum(count for status, count in outcomes.items() if status != "200")
    result = {
        "clients": args.clients, "seconds": round(elapsed, 1), "max_batch": args.max_batch,
        "answered": outcomes["200"], "failed": failed, "outcomes": dict(outcomes),
        "tokens_per_s": round(tokens / elapsed, 1),
        "queue_wait_ms": {"p50": round(float(np.percentile(waits, 50)), 1),
                          "p99": round(float(np.percentile(waits, 99)), 1)},
        "ttft_ms": {"p50": round(float(np.percentile(ttfts, 50)), 1), "p99": round(float(np.percentile(ttfts, 99)), 1)},
    }
    print(f"v41 bench load: {model}, {args.clients} streaming clients for {elapsed:.0f} s, max_batch "
          f"{args.max_batch}, max_queued_requests {args.max_queued}")
    print(f"{'answered':>9}  {'failed':>6}  {'tokens/s':>8}  {'queue wait p50 / p99 ms':>24}  {'TTFT p50 / p99 ms':>18}")
    print(f"{result['answered']:>9}  {failed:>6}  {result['tokens_per_s']:>8.1f}  "
          f"{result['queue_wait_ms']['p50']:>11.0f} / {result['queue_wait_ms']['p99']:<10.0f}  "
          f"{result['ttft_ms']['p50']:>8.0f} / {result['ttft_ms']['p99']:<8.0f}")
    if failed:
        print("failures:", {status: count for status, count in outcomes.items() if status != "200"})
    if args.json:
        print(json.dumps(result))
    return 0
