"""The whole application on this machine: an embedded Redis, a local Ray, the Serve app.

:func:`local_app` is what `v41 serve`, the benches and the retention lab's replayer start;
:func:`serve_environment` holds the Ray Serve settings it runs with.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
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


def cluster_environment() -> dict[str, str]:
    """Ray's node health checks for a cluster of machines (`v41 serve --print-env`): the
    control store declares a node dead after 20 failed checks 3 s apart (~60 s, not
    Ray's ~15 s), so that a host cut off for half a minute keeps its actors and its
    raylet rejoins when the link is back. A lost host is the router's to notice, in
    seconds (:mod:`cluster.serving.liveness`), not Ray's."""
    return {"RAY_health_check_period_ms": "3000", "RAY_health_check_timeout_ms": "3000",
            "RAY_health_check_failure_threshold": "20"}


def use_serve_environment(port: int) -> None:
    os.environ.update(serve_environment(port))

class _ReadyAtFilter(logging.Filter):
    """Drops Serve's "Application ... is ready at <its proxy's URL>": with direct
    ingress the router answers on our port, and the proxy's spare port is unused."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is ready at" not in record.getMessage()


@contextlib.contextmanager
def local_app(app_args: dict, host: str = "127.0.0.1", port: int = 8000, object_store_mb: int = 512,
              address: str | None = None, num_cpus: int | None = None, on_ray_starting=None, on_ray_started=None):
    """An embedded Redis (restarted by a supervisor if it dies; none if ``app_args``
    names a ``redis_url``), Ray (a new local instance, or the cluster at ``address``,
    started after :func:`use_serve_environment`) and the application with
    ``app_args``, its router answering at ``http://host:port``. Yields the supervisor
    (``.server`` is the Redis server; None with an external Redis); stops everything it
    started on the way out. ``on_ray_starting()`` runs just before Ray starts and
    ``on_ray_started()`` once it is up: a caller that handles SIGINT and SIGTERM itself
    (``v41 serve``) defers them in between, for a signal that unwinds ``ray.init``
    half-way leaves the Ray processes it had started running; given ``on_ray_starting``,
    ``ray.init`` keeps the caller's SIGTERM handler (it would set one that exits)."""
    import ray
    from ray import serve

    from cluster.serving.app import build_app
    from storage.redis_server import RedisServer, RedisSupervisor, free_port

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # is someone listening there?
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server will
        try:
            probe.bind((host, port))
        except OSError as error:
            from cluster import UserError

            raise UserError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    use_serve_environment(port)
    redis, supervisor = None, None
    if not app_args.get("redis_url"):
        redis = RedisServer()
        redis.start()
        supervisor = RedisSupervisor(redis)
        supervisor.start()
        # Its URL holds its random password: handed to Serve in memory, never on a command line.
        app_args = {**app_args, "redis_url": redis.url}
    ready_filter = _ReadyAtFilter()
    logging.getLogger("ray.serve").addFilter(ready_filter)
    try:
        if on_ray_starting is not None:
            on_ray_starting()
        with _sigterm_handler_kept() if on_ray_starting is not None else contextlib.nullcontext():
            if address is None:
                from cluster.serving.ray_token import ensure_private_token

                if (warning := ensure_private_token()) is not None:
                    logging.getLogger(__name__).warning(warning)
                num_cpus = (num_cpus or os.cpu_count() or 1) + expert_worker_cpus(app_args)
                # address "local": a new instance even where another runs on this machine
                # (a `ray start` cluster, another v41): ray.init() alone would join that one.
                ray.init(address="local", namespace="v41", object_store_memory=object_store_mb << 20, num_cpus=num_cpus,
                         include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, namespace="v41", log_to_driver=False)
                if not app_args.get("router_resources"):  # clients call this node: the router listens here
                    app_args = {**app_args, "router_resources": {f"node:{ray.util.get_node_ip_address()}": 0.001}}
        if on_ray_started is not None:
            on_ray_started()
        serve.start(http_options={"host": host, "port": free_port(host)})  # Serve's proxy: unused
        serve.run(build_app(app_args), name="v41", route_prefix="/")
        yield supervisor
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            if supervisor is not None:
                supervisor.stop()
                redis.stop()
            logging.getLogger("ray.serve").removeFilter(ready_filter)


def expert_worker_cpus(app_args: dict) -> int:
    """The CPUs the split replicas' expert workers ask for (each worker's bundle):
    a one-machine Ray offers them on top of its cores, the workers being processes
    that share the cores with the replicas whose MoE layers they run."""
    from actors.config import AppConfig

    config = AppConfig.from_args(app_args)
    total = 0.0
    for replicas, parallel in ((config.prefill_replicas, config.prefill_parallel),
                               (config.decoder_max_replicas or config.decoder_replicas, config.decoder_parallel)):
        total += replicas * (parallel.experts - 1) * parallel.worker_resources.get("CPU", 0.0)
    return int(-(-total // 1))

def default_model() -> Path:
    """The shipped small checkpoint, wherever the command runs from."""
    from actors.config import DEFAULT_MODEL

    return Path(DEFAULT_MODEL)


@contextlib.contextmanager
def _sigterm_handler_kept():
    """``ray.init`` leaves the SIGTERM handler as it is: it begins by setting one that
    exits (``ray._private.utils.set_sigterm_handler``; where a Ray version has no such
    function, its handler is set and a SIGTERM while it starts exits as ``SystemExit``)."""
    from ray._private import utils

    original = getattr(utils, "set_sigterm_handler", None)
    if original is None:
        yield
        return
    utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = original
