"""The decoder's stream as the router reads it, the engine thread's queue, and the
serve bench's arithmetic of where a served token's time goes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from actors.events import Stored, Token, Tokens, TokenStream
from actors.metrics import LoopStats
from actors.replica import EngineThread
from cluster.bench.serve_streams import Cpu, breakdown

pytestmark = pytest.mark.unit


class _Stream:
    """A Serve response generator's surface: its items, then the end; cancel noted."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self):
        self.cancelled = True


def test_the_router_reads_each_token_of_each_item_in_order_then_the_stored_event():
    tokens = [Token(i, f"t{i}") for i in range(5)]
    stored = Stored(12.5, True)
    stream = TokenStream(_Stream([Tokens(tuple(tokens[:1])), Tokens(tuple(tokens[1:4])), Tokens((tokens[4],)), stored]))

    async def read():
        first = await stream.__anext__()
        return [first] + [event async for event in stream]

    assert asyncio.run(read()) == tokens + [stored]
    stream.cancel()
    assert stream.stream.cancelled


def test_the_engine_thread_counts_the_jobs_waiting_behind_the_running_one():
    engine = EngineThread()
    release = threading.Event()
    try:
        running = engine.submit(release.wait, 30)
        queued = [engine.submit(lambda n=n: n) for n in range(3)]
        while not running.running():  # the first job has left the queue
            pass
        assert engine.waiting == 3
        assert queued[2].cancel()  # a job cancelled before it ran is no longer waiting
        assert engine.waiting == 2
        release.set()
        assert [future.result(30) for future in queued[:2]] == [0, 1]
        assert engine.waiting == 0
    finally:
        release.set()
        engine.shutdown(wait=True)


def test_where_a_served_token_goes_is_each_parts_cpu_over_the_tokens():
    # 2,000 tokens over 10 s: the decoder process spent 6 s of CPU, 5 of them in steps
    # (5.5 s of wall in steps); the router 1 s, the client 0.5 s, the machine 9 s in all.
    cpu = Cpu(machine_s=9.0, router_s=1.0, decoder_s=6.0, client_s=0.5, wall_s=10.0)
    loop = LoopStats(runs=3, steps=125, tokens=2000, step_s=5.5, step_cpu_s=5.0, items=500)
    where = breakdown(2000, cpu, loop)
    assert where == pytest.approx({
        "engine_step_us": 2500.0, "decoder_other_us": 500.0, "router_us": 500.0, "client_us": 250.0,
        "rest_of_machine_us": 750.0, "engine_busy_share": 0.55, "tokens_per_item": 4.0, "tokens_per_step": 16.0})
    before = Cpu(1.0, 0.5, 2.0, 0.25, 100.0)
    assert (Cpu(3.0, 1.0, 5.0, 0.5, 104.0) - before).values() == (2.0, 0.5, 3.0, 0.25, 4.0)
