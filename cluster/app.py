"""The Ray Serve application: the router (ingress), the prefill pool, the decoder pool.

``build_app(args)`` validates its arguments into an :class:`AppConfig` and wires the
deployments with ``.bind()``; ``serve run cluster.app:build_app`` and the YAML
configs in ``configs/`` use it. The deployments live beside the logic they run:
:class:`actors.prefill.PrefillPool`, :class:`actors.decoder.DecoderPool`,
:class:`cluster.router.Router`.
"""

from __future__ import annotations

from typing import Any

from actors.decoder import DecoderPool
from actors.prefill import PrefillPool
from cluster.config import AppConfig
from cluster.router import Router


def build_app(args: dict[str, Any] | None = None):
    """The application: ``serve run cluster.app:build_app key=value ...`` or a YAML's ``args``."""
    config = AppConfig.from_args(args)
    prefill = PrefillPool.options(
        num_replicas=config.prefill_replicas,
        ray_actor_options={"num_cpus": 1, "resources": dict(config.prefill_resources)},
    ).bind(config)
    decoder = DecoderPool.options(
        num_replicas=config.decoder_replicas,
        ray_actor_options={"num_cpus": 1, "resources": dict(config.decoder_resources)},
    ).bind(config)
    return Router.options(ray_actor_options={"num_cpus": 0}).bind(config, prefill, decoder)
