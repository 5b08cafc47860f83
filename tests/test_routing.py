"""Cache-affinity routing: the cache's node first, unless its replicas are busier than
the least loaded by more than the slack."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.routing import MOVE_SLACK, rank_replicas


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
    from cluster.routing import NodeLoad

    load = NodeLoad(slack=0)
    assert load.prefer(["B"]) == ["B"]  # no node seen serving yet: the cache's order as is
    for node in ("A", "B"):
        load.seen(node)
    assert load.prefer(["B", "A"]) == ["B", "A"]  # a tie: the cache wins
    load.started("B")
    # One more request waiting for its first token on B: it goes to A, its cache moves.
    assert load.prefer(["B", "A"]) == ["A", "B"]
    assert load.prefer([]) == ["A"]  # nothing cached: the least loaded node
    load.started("A")
    assert load.prefer(["B"]) == ["B"]
    load.answered("B")
    load.answered("B")  # more answers than requests never go below zero
    assert load.pending == {"A": 1, "B": 0}
    assert load.prefer(["A"]) == ["B", "A"]
    patient = NodeLoad(slack=1)  # waits behind one more admission for its cache
    patient.seen("A")
    patient.started("B")
    assert patient.prefer(["B"]) == ["B"]
    patient.started("B")
    assert patient.prefer(["B"]) == ["A", "B"]


def test_the_routers_let_serve_back_off_when_every_replica_is_full():
    """Serve retries a request whose ranks were all full at once, in a loop of probes to
    the replicas, unless the router asks it to back off (its own locality mixin does;
    a custom router must): the loop halved a decoder replica's throughput."""
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.request_router.common import PendingRequest

    from cluster.routing import PrefixAffinityRouter, RoundRobinRouter

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

    # The router chose it knowing every node's backlog (NodeLoad): Serve's lagging
    # queue lengths only order the others, should it be gone or full.
    assert order({"a1": 0, "a2": MOVE_SLACK + 3, "b1": 1}) == [["a2"], ["a1", "b1"]]
    # A replica that is gone: the node order as before.
    assert order({"a1": 1, "a2": 0, "b1": 0}, kept="zz") == [["a1", "a2"], ["b1"]]
