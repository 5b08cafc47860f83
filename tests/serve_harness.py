"""Start and stop the Serve app for end-to-end tests (a real Ray instance, a real Redis)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import ray
from ray import serve

from cluster.app import build_app
from cluster.commands.serve import use_serve_environment
from storage.redis_server import RedisServer, free_port

GOLDEN = Path(__file__).parent / "golden" / "A"


@contextlib.contextmanager
def running_app(tmp_path: Path, address: str | None = None, **args):
    """Yields the base URL of the app (``http://127.0.0.1:PORT``) and the Redis URL."""
    use_serve_environment()  # the settings `v41 serve` runs with
    redis = RedisServer()
    redis.start()
    port = free_port()
    try:
        if address is None:
            ray.init(num_cpus=4, object_store_memory=256 << 20, include_dashboard=False, namespace="v41",
                     log_to_driver=False)
        else:
            ray.init(address=address, namespace="v41", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = {"model": str(GOLDEN), "redis_url": redis.url, "ssd_dir": str(tmp_path / "ssd-{node}"),
                  "chunk_tokens": 32, **args}
        serve.run(build_app(config), name="v41", route_prefix="/")
        yield f"http://127.0.0.1:{port}", redis
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        redis.stop()
        time.sleep(0.5)
