"""A trace replayed against a live `v41 serve`: the check that the simulator says what
the cluster does (``v41 cache-sim validate``).

- :func:`trace_slice` takes whole conversations from a Mooncake trace (a conversation:
  the requests that share the block after the shared root), the first ones to start,
  within the first minutes, prompts cut to a length the CPU model serves quickly.
- :func:`prompt_ids` makes each 512-token block a fixed run of token ids (seeded by
  its hash id), so that two rows sharing a block prefix share exactly those tokens, as
  the trace means.
- :func:`replay` sends the rows open-loop at their times (compressed by ``speedup``)
  with bounded concurrency to ``/v1/completions``, and records when each was sent and
  answered, its usage (prompt and cached tokens), and the two moments the server
  reports that decide what it found: when it looked up the stored prefix (the
  router's index lookup; the prefill's read, after its queue, where no index
  answered) and when its conversation was stored (just before its last token went
  out). With ``restart_at``, it stops
  before that row, lets the requests in flight finish, calls ``restart`` (the cluster's
  store is killed and comes back), and goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from cluster.lab.workload import BLOCK_TOKENS


def trace_slice(rows: list[dict], conversations: int, minutes: float, max_prompt_tokens: int,
                max_output_tokens: int) -> list[dict]:
    """The rows of the first ``conversations`` conversations that start within
    ``minutes``, their turns within ``minutes`` too; prompts cut to
    ``max_prompt_tokens`` (blocks past the cut dropped), answers to ``max_output_tokens``."""
    horizon_ms = minutes * 60_000
    chosen: list[int] = []
    out = []
    for row in rows:
        ids = row["hash_ids"]
        if row["timestamp"] > horizon_ms or len(ids) < 2:
            continue
        conversation = ids[1]
        if conversation not in chosen:
            if len(chosen) == conversations:
                continue
            chosen.append(conversation)
        prompt = min(int(row["input_length"]), max_prompt_tokens)
        out.append({"timestamp": row["timestamp"], "input_length": prompt,
                    "output_length": max(2, min(int(row["output_length"]), max_output_tokens)),
                    "hash_ids": ids[: -(-prompt // BLOCK_TOKENS)]})
    return out


def prompt_ids(row: dict, vocab_size: int, first_id: int = 16) -> list[int]:
    """The row's prompt: each block's fixed tokens (ids in [first_id, vocab_size),
    past the special tokens), cut to its length."""
    tokens: list[int] = []
    for block in row["hash_ids"]:
        tokens += np.random.default_rng([7, block]).integers(first_id, vocab_size, BLOCK_TOKENS).tolist()
    return tokens[: row["input_length"]]


@dataclass
class Sent:
    """One replayed request: times in seconds since the replay started."""

    sent_s: float
    done_s: float
    prompt_tokens: int
    cached_tokens: int
    status: int
    error: str = ""
    lookup_s: float | None = None  # when the cluster looked up the stored prefix (x-v41-lookup-at)
    stored_s: float | None = None  # when the conversation was stored (x-v41-stored-at)


async def replay(url: str, model: str, rows: list[dict], vocab_size: int, speedup: float = 1.0,
                 concurrency: int = 4, restart_at: int | None = None,
                 restart: Callable[[], Awaitable[None]] | None = None,
                 headers: dict[str, str] | None = None) -> tuple[list[Sent], float | None]:
    """Send ``rows`` (see the module docstring); returns one :class:`Sent` per row, in
    order, and when the restart happened (None without one)."""
    import aiohttp

    started = time.monotonic()
    epoch = time.time()  # the server's marks are Unix times (one machine: one clock)
    limit = asyncio.Semaphore(concurrency)
    results: list[Sent | None] = [None] * len(rows)
    shift = 0.0  # the pause for the restart: later rows move by it
    restarted_s = None

    async def send(session, index: int, row: dict) -> None:
        body = {"model": model, "prompt": prompt_ids(row, vocab_size), "max_tokens": row["output_length"],
                "temperature": 0.0}
        async with limit:
            sent = time.monotonic() - started
            try:
                async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
                    answer = await response.json()
                    status = response.status
            except (TimeoutError, aiohttp.ClientError) as error:
                results[index] = Sent(sent, time.monotonic() - started, 0, 0, 0, f"{type(error).__name__}: {error}")
                return
            usage = answer.get("usage") or {}
            looked, stored = (response.headers.get(f"x-v41-{name}-at") for name in ("lookup", "stored"))
            results[index] = Sent(sent, time.monotonic() - started, int(usage.get("prompt_tokens", 0)),
                                  int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)), status,
                                  "" if status == 200 else str(answer.get("error", answer))[:200],
                                  None if looked is None else float(looked) - epoch,
                                  None if stored is None else float(stored) - epoch)

    t0 = rows[0]["timestamp"] if rows else 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        tasks: list[asyncio.Task] = []
        for index, row in enumerate(rows):
            if index == restart_at and restart is not None:
                await asyncio.gather(*tasks)  # the requests in flight end first
                pause = time.monotonic()
                restarted_s = pause - started
                await restart()
                shift += time.monotonic() - pause
            due = (row["timestamp"] - t0) / 1000.0 / speedup + shift
            delay = due - (time.monotonic() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(send(session, index, row)))
        await asyncio.gather(*tasks)
    return [r for r in results if r is not None], restarted_s
