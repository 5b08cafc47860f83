"""`v41 bench serve`'s streams: N clients streaming through HTTP against the engine's
own batched decode at batch N, on the same weights and the same step, and where the
difference goes.

Each side's rate is the median of :data:`ROUNDS` runs. The engine's rate is measured in this process before Ray starts (:func:`engine_rates`:
the decoder replica's own batch, speculation included, run without the serving stack). The served rate (:func:`served_streams`) is N clients at once, each streaming
a ``--tokens``-token answer; counted from each stream's first token to its last, so
that both sides count decode only. Around the served run the bench reads the CPU time
of each process it can name (the router's and the decoder's replicas through Ray,
this process, the machine's total from ``/proc/stat``) and the decoder replica's
:class:`actors.metrics.LoopStats` (its steps' wall and CPU time); :func:`breakdown`
turns them into CPU microseconds per token delivered, by part, and the share of the
run the engine thread spent stepping.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.bench.sse import sse_chunks

ROUNDS = 3  # each side's rate is the median of this many runs


def engine_rates(app_args: dict, prompts: list[list[int]], batches: list[int], tokens: int,
                 banned: tuple[int, ...]) -> dict[int, tuple[float, float]]:
    """Decode tokens/s of the decoder replica's own loop at each batch size, in this
    process: the model, engine and speculation the replica builds from ``app_args``
    (:class:`actors.replica.ModelBundle`), its :class:`model.runtime.batcher.Batcher`
    admitting the first ``batch`` prompts, then stepping until every request has its
    ``tokens`` tokens (greedy, the ``banned`` tokens, the stop tokens, biased out: as the
    served streams ask): (tokens/s: the tokens after each request's first over the
    steps' time; tokens per step, which speculation makes more than one)."""
    from actors.config import AppConfig
    from actors.replica import ModelBundle
    from model.runtime.batcher import Batcher
    from model.runtime.sampling import SamplingParams

    config = AppConfig.from_args(app_args)
    bundle = ModelBundle(config)
    batcher = Batcher(bundle.engine, bundle.tokenizer, bundle.eos_ids, config.max_batch,
                      speculation=bundle.speculation(config))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, logit_bias=tuple((t, -100.0) for t in banned))
    rates: dict[int, list[tuple[float, float]]] = {}
    for batch in [batches[0], *batches]:  # (the first level once more: its first run warms up)
        for round_ in range(ROUNDS):
            for i, prompt in enumerate(prompts[:batch]):
                batcher.add(f"{batch}-{round_}-{i}", params, prompt=prompt)
            made, steps, start = 0, 0, time.perf_counter()
            while batcher.running:
                made, steps = made + len(batcher.step()), steps + 1
            rates.setdefault(batch, []).append((made / (time.perf_counter() - start), made / steps))
    return {batch: (statistics.median(r for r, _ in runs[-ROUNDS:]), statistics.median(t for _, t in runs[-ROUNDS:]))
            for batch, runs in rates.items()}


@dataclass(frozen=True)
class Cpu:
    """CPU seconds so far: the machine's (all cores, from ``/proc/stat``), and by process."""

    machine_s: float
    router_s: float
    decoder_s: float
    client_s: float
    wall_s: float

    def __sub__(self, before: Cpu) -> Cpu:
        return Cpu(*(a - b for a, b in zip(self.values(), before.values())))

    def values(self) -> tuple[float, ...]:
        return self.machine_s, self.router_s, self.decoder_s, self.client_s, self.wall_s


def machine_cpu_s() -> float:
    """CPU seconds every core of this machine spent busy since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def replica_pid(deployment: str) -> int:
    """The process of ``deployment``'s (first) replica in this Ray instance."""
    import ray
    from ray.util import list_named_actors

    name = next(a["name"] for a in list_named_actors(all_namespaces=True) if deployment in a["name"])
    actor = ray.get_actor(name, namespace="serve")
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


def cpu_now(router_pid: int, decoder_pid: int) -> Cpu:
    return Cpu(machine_cpu_s(), process_cpu_s(router_pid), process_cpu_s(decoder_pid), time.process_time(),
               time.perf_counter())


@dataclass(frozen=True)
class StreamTimes:
    """One streamed request: when it was sent, its first and last token came
    (``time.perf_counter``; the send time where none came), and its usage."""

    sent: float
    first: float
    last: float
    usage: dict

    @property
    def ttft_s(self) -> float:
        return self.first - self.sent

    @property
    def tokens(self) -> int:
        return self.usage.get("completion_tokens", 0)


async def timed_stream(session, url: str, body: dict) -> StreamTimes:
    """Stream ``body`` (a chat request) and time it."""
    sent, first, last = time.perf_counter(), None, None
    usage = {}
    async with session.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {await reply.text()}")
        async for chunk in sse_chunks(reply):
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            usage = chunk.get("usage") or usage
            if any(choice["delta"].get("content") for choice in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    return StreamTimes(sent, first or sent, last or sent, usage)


async def served_streams(session, url: str, bodies: list[dict]) -> tuple[float, int, list[float]]:
    """(decode tokens/s, tokens, each stream's seconds to its first token) of the
    streams of ``bodies`` at once; the rate counts the tokens after each stream's
    first, over the span from the first first token to the last token."""
    runs = await asyncio.gather(*[timed_stream(session, url, body) for body in bodies])
    span = max(run.last for run in runs) - min(run.first for run in runs)
    tokens = sum(max(0, run.tokens - 1) for run in runs)
    return tokens / span if span > 0 else 0.0, sum(run.tokens for run in runs), [run.ttft_s for run in runs]


def breakdown(tokens: int, cpu: Cpu, loop) -> dict[str, float]:
    """Where a served token's time goes, from the CPU and loop counters' differences
    over one run: CPU microseconds per token delivered by part (the engine's steps;
    the decoder replica's other threads: its event loop, Ray's streaming of items; the
    router's process; the client, this process; the rest of the machine: Ray's own
    processes, the store, Redis), the share of the run the engine thread spent in
    steps, and tokens per stream item."""
    per = 1e6 / max(tokens, 1)
    rest = cpu.machine_s - cpu.router_s - cpu.decoder_s - cpu.client_s
    return {
        "engine_step_us": loop.step_cpu_s * per,
        "decoder_other_us": max(0.0, cpu.decoder_s - loop.step_cpu_s) * per,
        "router_us": cpu.router_s * per,
        "client_us": cpu.client_s * per,
        "rest_of_machine_us": max(0.0, rest) * per,
        "engine_busy_share": loop.step_s / cpu.wall_s if cpu.wall_s > 0 else 0.0,
        "tokens_per_item": loop.tokens / loop.items if loop.items else 0.0,
        "tokens_per_step": loop.tokens / loop.steps if loop.steps else 0.0,
    }


def print_streams(rows: dict[int, dict], tokens: int) -> None:
    """The streams table: served against the engine, and where a token's time goes."""
    print(f"{tokens}-token streams: decode tokens/s through HTTP against the engine's batched decode "
          "(same weights, same step)")
    print(f"{'clients':>8}  {'TTFT p50 ms':>12}  {'served':>8}  {'engine':>8}  {'ratio':>6}  "
          f"{'engine busy':>11}  {'tok/item':>8}  {'tok/step served / engine':>24}")
    for n, row in rows.items():
        where = row["where_us_per_token"]
        per_step = f"{where['tokens_per_step']:.2f} / {row['engine_tokens_per_step']:.2f}"
        print(f"{n:>8}  {row['ttft_ms_p50']:>12.1f}  {row['tokens_per_s']:>8.1f}  {row['engine_tokens_per_s']:>8.1f}  "
              f"{row['served_over_engine']:>6.2f}  {where['engine_busy_share']:>11.2f}  {where['tokens_per_item']:>8.2f}  "
              f"{per_step:>24}")
    print("CPU us per served token: engine steps | decoder replica, the rest | router | client | rest of the machine")
    for n, row in rows.items():
        where = row["where_us_per_token"]
        print(f"{n:>8}  {where['engine_step_us']:>8.0f} | {where['decoder_other_us']:>8.0f} | "
              f"{where['router_us']:>8.0f} | {where['client_us']:>8.0f} | {where['rest_of_machine_us']:>8.0f}")
