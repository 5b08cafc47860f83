"""Start and stop the Serve app for end-to-end tests (a real Ray instance, a real Redis).

Two ways. :func:`running_app` starts the whole stack as `v41 serve` does (Redis, Ray,
Serve, the app) and stops all of it: for a test that restarts the stack or runs it on a
cluster of its own. :class:`ServeRuntime` (the session fixture ``serve_runtime``) keeps
one Ray instance, Serve controller and Redis server for the apps of consecutive tests
and deploys each app on them in turn (about 10-25 s less per app on two cores); an app
leaves nothing for the next: its deployments are deleted, the detached actors it made
(the stores and the Engram holder, namespace "v41") killed, and its Redis keys deleted.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from cluster.serving.local import local_app
from storage.redis_server import free_port

GOLDEN = Path(__file__).parent / "golden" / "A"
# local_app's 4, and room for the expert workers of a split app (test_parallel's: one
# CPU each for its prefill and its decoder replica).
RUNTIME_CPUS = 6


def app_config(tmp_path: Path, args: dict) -> dict:
    """The app's arguments: the golden model, its stores under ``tmp_path``, 32-token
    chunks, the eager step (tests/integration/test_compiled.py serves the compiled one),
    answers of at most 256 tokens (the golden model's weights are random: an answer that
    sets no length would run to the end of the context), then ``args``."""
    return {"model": str(GOLDEN), "ssd_dir": str(tmp_path / "ssd-{node}"), "chunk_tokens": 32,
            "compiled_step": False, "max_answer_tokens": 256, **args}


@contextlib.contextmanager
def running_app(tmp_path: Path, address: str | None = None, port: int | None = None, **args):
    """Yields the base URL of the app (``http://127.0.0.1:PORT``) and the Redis
    supervisor (``.server``: the Redis server), started as `v41 serve` starts them. With ``address`` (a cluster started after
    ``use_serve_environment(port)``), give the same ``port``."""
    port = port or free_port()
    try:
        with local_app(app_config(tmp_path, args), port=port, object_store_mb=256, address=address,
                       num_cpus=4) as supervisor:
            yield f"http://127.0.0.1:{port}", supervisor
    finally:
        time.sleep(0.5)


class ServeRuntime:
    """Ray, Serve and Redis kept for the apps of consecutive tests (see the module's
    docstring); started by the first :meth:`app`, stopped by :meth:`close` (tests/conftest.py
    closes it after the last test in a row that uses it)."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._port = 0
        self._supervisor = None

    @contextlib.contextmanager
    def app(self, tmp_path: Path, **args):
        """As :func:`running_app` yields: the app with ``args`` deployed, its URL and the
        Redis supervisor; on the way out it is removed with everything it left."""
        from ray import serve

        from cluster.serving.app import build_app

        config = app_config(tmp_path, args)
        if self._stack is None:
            stack = contextlib.ExitStack()
            self._port = free_port()
            self._supervisor = stack.enter_context(
                local_app(config, port=self._port, object_store_mb=256, num_cpus=RUNTIME_CPUS))
            self._stack = stack  # (set once up: a start that failed has stopped what it started)
        else:
            serve.run(build_app({**config, "redis_url": self._supervisor.server.url}), name="v41", route_prefix="/")
        try:
            yield f"http://127.0.0.1:{self._port}", self._supervisor
        finally:
            self._clear()

    def _clear(self) -> None:
        import ray
        import redis
        from ray import serve
        from ray.util import list_named_actors

        serve.delete("v41")
        for actor in list_named_actors(all_namespaces=True):
            if actor["namespace"] == "v41":
                with contextlib.suppress(ValueError):  # (gone already)
                    ray.kill(ray.get_actor(actor["name"], namespace="v41"))
        client = redis.Redis.from_url(self._supervisor.server.url)
        keys = list(client.scan_iter(count=1000))  # (FLUSHALL is renamed away: storage/redis_server.py)
        if keys:
            client.delete(*keys)

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
            time.sleep(0.5)  # (as running_app: the ports' sockets linger a moment)


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


def sdk_client(url: str):
    """An OpenAI SDK client of the app at ``url`` (no retries: a test sees every answer)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def post_json(url: str, body: bytes) -> tuple[int, dict]:
    """POST ``body`` as JSON: (status, the answer's JSON), an error's included."""
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
