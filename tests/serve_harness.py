"""Start and stop the Serve app for end-to-end tests (a real Ray instance, a real Redis)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from cluster.serving.local import local_app
from storage.redis_server import free_port

GOLDEN = Path(__file__).parent / "golden" / "A"


@contextlib.contextmanager
def running_app(tmp_path: Path, address: str | None = None, port: int | None = None, **args):
    """Yields the base URL of the app (``http://127.0.0.1:PORT``) and the Redis
    supervisor (``.server``: the Redis server), started as `v41 serve` starts them. With ``address`` (a cluster started after
    ``use_serve_environment(port)``), give the same ``port``."""
    port = port or free_port()
    config = {"model": str(GOLDEN), "ssd_dir": str(tmp_path / "ssd-{node}"), "chunk_tokens": 32, **args}
    try:
        with local_app(config, port=port, object_store_mb=256, address=address, num_cpus=4) as supervisor:
            yield f"http://127.0.0.1:{port}", supervisor
    finally:
        time.sleep(0.5)


def one_process_greedy(directory: Path, prompt: list[int], n: int) -> str:
    """The text of a request's ``n`` greedy tokens computed in this process, as a cold
    turn is served without speculation (prefill, bounded replay, decode)."""
    from model.loader import load_hasher, load_model, load_tokenizer
    from model.runtime.engine import Engine

    config, model = load_model(directory)
    engine = Engine(model, load_hasher(directory, config))
    cache = engine.new_cache()
    tokens = [int(engine.replay(cache, engine.prefill(cache, prompt)).argmax())]
    while len(tokens) < n:
        tokens.append(int(engine.decode([(cache, [tokens[-1]])])[0][-1].argmax()))
    return load_tokenizer(directory).decode(tokens)


def wait_until(condition, timeout: float = 60.0, what: str = "the condition") -> None:
    """Poll ``condition()`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.05)


def stored_objects() -> int:
    """Objects in every node's store once its writes have landed and its index entries
    are published (a conversation is written after its answer is out)."""
    import ray

    from actors.store import store_actors

    total = 0
    for store in store_actors().values():
        ray.get(store.flush.remote())
        stats = ray.get(store.stats.remote())
        if stats.index_pending:
            return -1
        total += sum(stats.objects.values())
    return total


def replica_actor_name(deployment: str) -> str:
    """The Ray actor name of a replica of ``deployment`` (in namespace "serve")."""
    from ray.util import list_named_actors

    names = [a["name"] for a in list_named_actors(all_namespaces=True) if deployment in a["name"]]
    assert names, f"no replica of {deployment}"
    return names[0]


def node_store_actor():
    """The store actor of this machine's (first) node."""
    import ray

    return ray.get_actor(f"v41-store-{ray.nodes()[0]['NodeID']}", namespace="v41")


def health(url: str) -> dict:
    """The body of ``/health`` (whatever its status code)."""
    return health_response(url)[1]


def health_response(url: str) -> tuple[int, dict]:
    """``/health``'s status code and body (503 while a pool has no replica running)."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
