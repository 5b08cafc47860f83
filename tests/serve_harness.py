"""Start and stop the Serve app for end-to-end tests (a real Ray instance, a real Redis)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from cluster.commands.serve import local_app
from storage.redis_server import free_port

GOLDEN = Path(__file__).parent / "golden" / "A"


@contextlib.contextmanager
def running_app(tmp_path: Path, address: str | None = None, port: int | None = None, **args):
    """Yields the base URL of the app (``http://127.0.0.1:PORT``) and the Redis server,
    started as `v41 serve` starts it. With ``address`` (a cluster started after
    ``use_serve_environment(port)``), give the same ``port``."""
    port = port or free_port()
    config = {"model": str(GOLDEN), "ssd_dir": str(tmp_path / "ssd-{node}"), "chunk_tokens": 32, **args}
    try:
        with local_app(config, port=port, object_store_mb=256, address=address, num_cpus=4) as redis:
            yield f"http://127.0.0.1:{port}", redis
    finally:
        time.sleep(0.5)
