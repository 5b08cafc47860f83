"""The router's view of lost hosts (cluster/serving/liveness.py) and a stream that ends
when its host is lost (actors/events.py TokenStream.lose): driven with an injected probe
(the fault) and Serve's stream replaced by an async generator that waits."""

from __future__ import annotations

import asyncio

import pytest

from actors.events import HostLost, TokenStream
from cluster.serving.liveness import NodeAddress, NodeLiveness, answers
from storage.index import Location
from storage.policy import TierName

pytestmark = pytest.mark.unit

NODES = [NodeAddress("a" * 56, "10.0.0.1", 1, True), NodeAddress("b" * 56, "10.0.0.2", 1, True)]


class Waiting:
    """A stream whose next item never comes (a host gone quiet), until cancelled."""

    def __init__(self):
        self.cancelled = False

    async def __anext__(self):
        await asyncio.Event().wait()

    def cancel(self):
        self.cancelled = True


def _liveness(reachable: set[str], nodes=NODES) -> NodeLiveness:
    async def probe(node, timeout_s):
        return node.host in reachable
    return NodeLiveness(nodes=lambda: list(nodes), probe=probe, misses=2)


def test_a_node_is_down_after_misses_in_a_row_and_back_at_its_first_answer():
    reachable = {"10.0.0.1", "10.0.0.2"}
    liveness = _liveness(reachable)
    copies = [(Location(NODES[0].node_id, TierName.RAM), Location(NODES[1].node_id, TierName.SSD))]
    replicas = {"r1": NODES[0].node_id, "r2": NODES[1].node_id}
    asyncio.run(liveness.check())
    reachable.discard("10.0.0.2")
    asyncio.run(liveness.check())
    assert not liveness.down  # one miss is not a lost host
    asyncio.run(liveness.check())
    assert set(liveness.down) == {NODES[1].node_id}
    assert liveness.usable(copies) == [(copies[0][0],)]
    assert liveness.live_replicas(replicas) == {"r1": NODES[0].node_id}
    assert len(liveness.problems()) == 1 and "not answering" in liveness.problems()[0]
    reachable.add("10.0.0.2")
    asyncio.run(liveness.check())
    assert not liveness.down and liveness.usable(copies) == copies and liveness.live_replicas(replicas) == replicas


def test_a_node_ray_declares_dead_is_excluded_for_good_and_the_index_told_once():
    dead = [NODES[0], NodeAddress(NODES[1].node_id, "10.0.0.2", 1, False)]
    liveness = _liveness({"10.0.0.1", "10.0.0.2"}, dead)
    told = []
    liveness.on_dead = told.append
    asyncio.run(liveness.check())
    asyncio.run(liveness.check())
    assert told == [[NODES[1].node_id]] and liveness.excluded(NODES[1].node_id)
    assert not liveness.problems()  # (Serve's pools report a dead node's replicas)


def test_a_waiting_read_ends_with_host_lost_when_its_host_goes_down():
    async def scenario():
        liveness = _liveness({"10.0.0.1"})
        raw = Waiting()
        stream = TokenStream(raw)
        liveness.watch(NODES[1].node_id, stream)
        liveness.watch(NODES[0].node_id, TokenStream(Waiting()))
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        assert not reader.done()
        await liveness.check()
        await liveness.check()
        with pytest.raises(HostLost, match="was lost"):
            await reader
        assert raw.cancelled and not reader.cancelled()
        with pytest.raises(HostLost):  # and every later read
            await stream.__anext__()
        late = TokenStream(Waiting())
        liveness.watch(NODES[1].node_id, late)  # a stream from a node already down ends at once
        with pytest.raises(HostLost, match="is down"):
            await late.__anext__()
    asyncio.run(scenario())


def test_a_stream_cancelled_by_its_caller_is_not_a_lost_host():
    async def scenario():
        stream = TokenStream(Waiting())
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
    asyncio.run(scenario())


def test_the_probe_is_a_tcp_connection():
    async def scenario():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        assert await answers(NodeAddress("n", "127.0.0.1", port, True), 1.0)
        server.close()
        await server.wait_closed()
        assert not await answers(NodeAddress("n", "127.0.0.1", port, True), 1.0)
    asyncio.run(scenario())


def test_failures_in_a_round_the_event_loop_was_late_for_are_not_counted():
    async def late_probe(node, timeout_s):
        await asyncio.sleep(0.2)  # (this loop held up for longer than the probes' timeout)
        return False
    liveness = NodeLiveness(nodes=lambda: NODES, probe=late_probe, timeout_s=0.05, misses=1)
    asyncio.run(liveness.check())
    assert not liveness.down
