"""Cache-affinity routing: the cache's node first, unless its replicas are busier than
the least loaded by more than the slack."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cluster.serving.routing import MOVE_SLACK, rank_replicas

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Replica:
    name: str
    node_id: str


A1, A2, B1, C1 = Replica("a1", "A"), Replica("a2", "A"), Replica("b1", "B"), Replica("c1", "C")


def ranks(preferred, loads, slack=MOVE_SLACK):
    result = rank_replicas([A1, A2, B1, C1], preferred, lambda r: loads.get(r.name), slack)
    return [[r.name for r in rank] for rank in result]


def test_the_cache_nodes_come_first_in_order_then_the_rest_by_load():
    assert ranks(["B", "A"], {"a1": 1, "a2": 0, "b1": 1, "c1": 0}) == [["b1"], ["a1", "a2"], ["c1"]]
    assert ranks([], {"a1": 3, "a2": 0, "b1": 1}) == [["a2", "b1", "a1", "c1"]]


def test_unknown_loads_go_last_among_the_rest():
    assert ranks(["C"], {"a1": 2, "b1": 0}) == [["c1"], ["b1", "a1", "a2"]]


def test_a_busy_cache_node_gives_way_to_the_least_loaded_replica():
    # Within the slack the cache wins.
    assert ranks(["B"], {"b1": MOVE_SLACK, "a1": 0, "a2": 0, "c1": 0})[0] == ["b1"]
    # Beyond it the request moves to the load (its cache is read from node B).
    moved = ranks(["B"], {"b1": MOVE_SLACK + 1, "a1": 2, "a2": 0, "c1": 1})
    assert moved == [["a2", "c1", "a1", "b1"]]
    # A larger slack waits longer for the cache.
    assert ranks(["B"], {"b1": 3, "a1": 0, "a2": 0, "c1": 0}, slack=3)[0] == ["b1"]


def test_the_routers_own_count_sends_a_request_to_its_cache_or_to_the_least_backlog():
    from cluster.serving.routing import DecoderLoad

    def chosen(*args, **kwargs):
        choice = load.choose(*args, **kwargs)
        return choice.replica, choice.node, choice.reason

    pool = {}
    load = DecoderLoad(lambda: pool, slack=0)
    assert load.choose(["B"]) is None  # the pool not known yet: Serve's ranks decide
    pool.update(a1="A", a2="A", b1="B")
    assert chosen(["B", "A"]) == ("b1", "B", "cache")  # a tie: the cache wins
    assert chosen(["B"], kept="a2") == ("a2", "A", "kept")  # the replica that keeps the conversation
    load.started("b1")
    # One more request waiting for its first token on b1: it goes to an idle replica
    # (its cache moves, read from B's store).
    assert chosen(["B", "A"])[1:] == ("A", "moved")
    assert chosen(["B"], kept="b1")[1:] == ("A", "moved")
    load.started("a1")
    assert chosen(["A"]) == ("a2", "A", "cache")  # the least loaded replica on the cache's node
    load.started("a2")
    assert chosen(["B"]) == ("b1", "B", "cache")  # every replica one behind: the cache wins
    load.answered("b1")
    load.answered("b1")  # more answers than requests never go below zero
    assert load.pending == {"a1": 1, "a2": 1, "b1": 0}
    assert chosen(["A"]) == ("b1", "B", "moved")
    # Nothing cached (or only where no replica runs): the least loaded replicas in turn,
    # so sessions spread over the pool.
    load.answered("a1")
    load.answered("a2")
    assert {chosen([])[0] for _ in range(6)} == {"a1", "a2", "b1"}
    assert chosen(["C"])[2] == "anywhere"
    # A replica that is gone (its kept conversation is read from the store elsewhere).
    assert chosen(["A"], kept="zz")[1:] == ("A", "cache")
    patient = DecoderLoad(lambda: {"a1": "A", "b1": "B"}, slack=1)  # waits behind one more admission
    patient.started("b1")
    assert patient.choose(["B"]).replica == "b1"
    patient.started("b1")
    assert patient.choose(["B"]).replica == "a1"


def test_the_affinity_router_publishes_the_pool_it_knows():
    """The ingress chooses among the replicas its handle's request router knows: the
    router publishes them as Serve updates them, and forgets a dead one."""
    from types import SimpleNamespace

    from cluster.serving.routing import PrefixAffinityRouter, known_replicas

    class Published(PrefixAffinityRouter):
        def __init__(self):  # (no Serve around: only what _publish reads)
            self._deployment_id = SimpleNamespace(app_name="app", name="DecoderPool")
            self.replicas = {}

        @property
        def curr_replicas(self):
            return self.replicas

    router = Published()
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=f"r{i}"), node_id=n) for i, n in enumerate("AB")]
    router.replicas = {r.replica_id.unique_id: r for r in replicas}  # (Serve keys them by ReplicaID)
    router._publish()
    assert known_replicas("app", "DecoderPool") == {"r0": "A", "r1": "B"}
    assert known_replicas("app", "PrefillPool") == {}
    del router.replicas["r0"]
    router._publish()
    assert known_replicas("app", "DecoderPool") == {"r1": "B"}


def test_the_routers_let_serve_back_off_when_every_replica_is_full():
    """Serve retries a request whose ranks were all full at once, in a loop of probes to
    the replicas, unless the router asks it to back off (its own locality mixin does;
    a custom router must): the loop halved a decoder replica's throughput."""
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.request_router.common import PendingRequest

    from cluster.serving.routing import PrefixAffinityRouter, RoundRobinRouter

    @dataclass(frozen=True)
    class ReplicaId:
        unique_id: str

    replicas = [SimpleNamespace(name=f"r{i}", node_id="a", replica_id=ReplicaId(f"r{i}")) for i in range(2)]
    router = SimpleNamespace(replica_queue_len_cache={}, _turn=0)

    async def ranks(router_class):
        pending = PendingRequest(args=[], kwargs={"preferred_nodes": ["a"]}, metadata=SimpleNamespace())
        assert not pending.routing_context.should_backoff
        chosen = await router_class.choose_replicas(router, replicas, pending)
        return chosen, pending.routing_context.should_backoff

    for router_class in (PrefixAffinityRouter, RoundRobinRouter):
        chosen, backs_off = asyncio.run(ranks(router_class))
        assert sorted(r.name for rank in chosen for r in rank) == ["r0", "r1"]
        assert backs_off, router_class.__name__


def test_the_replica_that_keeps_the_conversation_comes_first():
    from types import SimpleNamespace

    def replica(name, node):
        return SimpleNamespace(name=name, node_id=node, replica_id=SimpleNamespace(unique_id=name))

    a1, a2, b1 = replica("a1", "A"), replica("a2", "A"), replica("b1", "B")

    def order(loads, kept="a2", nodes=("A",)):
        ranked = rank_replicas([a1, a2, b1], list(nodes), lambda r: loads.get(r.name), preferred_replica=kept)
        return [[r.name for r in rank] for rank in ranked]

    # The router chose it knowing every replica's backlog (DecoderLoad): Serve's lagging
    # queue lengths only order the others, should it be gone or full.
    assert order({"a1": 0, "a2": MOVE_SLACK + 3, "b1": 1}) == [["a2"], ["a1", "b1"]]
    # A replica that is gone: the node order as before.
    assert order({"a1": 1, "a2": 0, "b1": 0}, kept="zz") == [["a1", "a2"], ["b1"]]


@pytest.mark.slow
@pytest.mark.integration
def test_the_ingress_knows_the_pool_and_its_choice_is_where_requests_go():
    """On a real Serve app: the affinity router in the caller's process publishes the
    pool's replicas (Serve ships the router class by value, so a global of its module
    would be a copy nobody reads), and each request goes to the replica named as its
    ``preferred_replica``."""
    import ray
    from ray import serve

    from cluster.serving.routing import request_router_config

    @serve.deployment(num_replicas=3, request_router_config=request_router_config("affinity"),
                      ray_actor_options={"num_cpus": 0})
    class Pool:
        def who(self, preferred_replica: str | None = None) -> str:
            return serve.get_replica_context().replica_id.unique_id

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Ingress:
        def __init__(self, pool):
            self.pool = pool

        async def __call__(self, preferred: str | None = None) -> tuple[dict, str]:
            from cluster.serving.routing import known_replicas

            answered = await self.pool.who.remote(preferred_replica=preferred)
            return known_replicas(self.pool.app_name, self.pool.deployment_name), answered

    from cluster.serving.local import use_serve_environment
    from storage.redis_server import free_port

    # Serve as the app runs it (direct ingress on a port of its own): a test before this
    # one may have left its environment, whose port is gone.
    use_serve_environment(free_port())
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        ingress = serve.run(Ingress.bind(Pool.bind()), name="routing-test", route_prefix=None)
        pool, _ = ingress.remote().result()
        assert len(pool) == 3 and len(set(pool.values())) == 1  # three replicas, this one node
        for replica in sorted(pool) * 3:
            assert ingress.remote(replica).result()[1] == replica
    finally:
        serve.shutdown()
        ray.shutdown()


def test_a_prompt_cache_key_sends_its_group_to_one_replica_while_nothing_is_cached():
    """``prompt_cache_key``: requests of one group, nothing of them cached yet, go to the
    group's replica (under the same slack as a cache's), and groups spread over the pool;
    a cached prefix or a kept conversation still decides first."""
    import hashlib

    from cluster.serving.routing import DecoderLoad

    pool = {"a1": "A", "a2": "A", "b1": "B"}
    load = DecoderLoad(lambda: pool, slack=1)
    groups = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(12)]
    first = [load.choose([], group=g) for g in groups]
    assert all(choice.reason == "group" for choice in first)
    assert [load.choose([], group=g).replica for g in groups] == [c.replica for c in first]  # stable
    assert len({c.replica for c in first}) == 3  # spread
    home = first[0].replica
    assert load.choose(["B"], group=groups[0]).node == "B"  # a cached prefix wins
    assert load.choose([], kept="a2", group=groups[0]).replica == "a2"
    load.started(home)
    assert load.choose([], group=groups[0]).replica == home  # within the slack
    load.started(home)
    assert load.choose([], group=groups[0]).reason == "moved"  # beyond it
