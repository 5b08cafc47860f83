"""Turns on a conversation across routers: two routers' record stores on one real Redis
server take turns changing a conversation (the Redis lock), a router that waits too long
gets a 409, and a router without Redis still takes turns with itself."""

from __future__ import annotations

import asyncio

import pytest

from cluster.serving import records
from cluster.serving.validation import ApiError
from cluster.serving.records import Records
from storage.redis_link import RedisLink
from storage.redis_server import RedisServer
from tests.redis_server import redis_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


def _records(url: str | None) -> Records:
    link = RedisLink(url, namespace="t-records", timeout_s=1, retry_s=0) if url else None
    return Records(node_store=lambda: None, peer_store=lambda node: None, here=lambda: "n1", link=link)


def test_two_routers_take_turns_on_a_conversation(redis_server: RedisServer, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(records, "LOCK_WAIT_S", 0.3)
    first, second = _records(redis_server.url), _records(redis_server.url)
    order: list[str] = []

    async def hold(router: Records, name: str, seconds: float) -> None:
        async with router._turn("conv_1"):
            order.append(f"{name} in")
            await asyncio.sleep(seconds)
            order.append(f"{name} out")

    async def run() -> None:
        # The second router waits for the first (0.1 s), and has the turn after it.
        await asyncio.gather(hold(first, "a", 0.1), asyncio.sleep(0.02))
        task = asyncio.ensure_future(hold(first, "a", 0.1))
        await asyncio.sleep(0.02)
        await asyncio.gather(task, hold(second, "b", 0.0))
        assert order == ["a in", "a out", "a in", "a out", "b in", "b out"]
        # Held longer than the wait: a 409 naming the conversation, and nothing entered.
        task = asyncio.ensure_future(hold(first, "a", 1.0))
        await asyncio.sleep(0.02)
        with pytest.raises(ApiError) as caught:
            await hold(second, "b", 0.0)
        assert caught.value.status == 409 and caught.value.code == "conversation_locked"
        await task
        await hold(second, "b", 0.0)  # free again
        # Another conversation is never held up by this one.
        task = asyncio.ensure_future(hold(first, "a", 1.0))
        await asyncio.sleep(0.02)
        async with second._turn("conv_2"):
            pass
        await task

    asyncio.run(run())
    assert not first._turns and not second._turns  # nothing left behind


def test_without_redis_a_router_takes_turns_with_itself() -> None:
    router, order = _records(None), []

    async def change(n: int) -> None:
        async with router._turn("conv_1"):
            order.append(n)
            await asyncio.sleep(0.01)
            order.append(n)

    async def run() -> None:
        await asyncio.gather(*(change(n) for n in range(4)))

    asyncio.run(run())
    assert all(order[2 * i] == order[2 * i + 1] for i in range(4)) and sorted(order[::2]) == [0, 1, 2, 3]
    assert not router._turns
