"""The Ray Serve application: the router (ingress), the prefill pool, the decoder pool.

``build_app(args)`` validates its arguments into an :class:`AppConfig` and wires the
deployments with ``.bind()``; ``serve run cluster.serving.app:build_app`` and the YAML
configs in ``configs/`` use it. The deployments live beside the logic they run:
:class:`actors.prefill.PrefillPool`, :class:`actors.decoder.DecoderPool`,
:class:`cluster.serving.ingress.Router`.
"""

from __future__ import annotations

from typing import Any

from actors.decoder import DecoderPool
from actors.prefill import PrefillPool
from actors.config import AppConfig
from cluster.serving.ingress import Router
from cluster.serving.routing import request_router_config


def decoder_options(config: AppConfig) -> dict[str, Any]:
    """The decoder pool's Serve options. A replica takes its batch and a few more
    requests (they wait in it for a place, and the prefetches get through); the rest
    wait at the router's handle, up to ``max_queued_requests``, then get 429. With
    ``decoder_max_replicas``, Serve's autoscaler reads the same numbers: it aims at one
    full batch of ongoing requests per replica."""
    options: dict[str, Any] = {
        "request_router_config": request_router_config(config.routing),
        "max_ongoing_requests": config.replica_places(),
        "max_queued_requests": config.max_queued_requests,
        "ray_actor_options": {"num_cpus": 1, "resources": dict(config.decoder_resources)},
        **health_options(config.decoder_parallel),
    }
    if config.decoder_max_replicas is None:
        options["num_replicas"] = config.decoder_replicas
    else:
        options["autoscaling_config"] = {"min_replicas": config.decoder_replicas,
                                         "max_replicas": config.decoder_max_replicas,
                                         "target_ongoing_requests": config.max_batch}
    return options


# A stopping replica checks for requests still running every 0.2 s, not Serve's 2 s: it
# waits as long for them (up to Serve's 20 s), and an idle one stops at once: `v41 serve`
# stopped in 6.0 s, 4.5 of them in serve.shutdown; now 2.8 and 1.4 (golden model, 2 cores).
STOPPING = {"graceful_shutdown_wait_loop_s": 0.2}


def health_options(parallel) -> dict[str, Any]:
    """A split replica is checked every 2 s (a lost expert worker fails its check, and
    Serve replaces the replica whole); an unsplit one at Serve's default."""
    return {"health_check_period_s": 2} if parallel.experts > 1 else {}


def build_app(args: dict[str, Any] | None = None):
    """The application: ``serve run cluster.serving.app:build_app key=value ...`` or a YAML's ``args``."""
    config = AppConfig.from_args(args)
    prefill = PrefillPool.options(
        num_replicas=config.prefill_replicas,
        request_router_config=request_router_config(config.routing),
        ray_actor_options={"num_cpus": 1, "resources": dict(config.prefill_resources)},
        **health_options(config.prefill_parallel), **STOPPING,
    ).bind(config)
    decoder = DecoderPool.options(**decoder_options(config), **STOPPING).bind(config)
    router_actor = {"num_cpus": 0, "resources": dict(config.router_resources)}
    return Router.options(ray_actor_options=router_actor, **STOPPING).bind(config, prefill, decoder)
