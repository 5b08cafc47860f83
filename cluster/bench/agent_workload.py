"""The agent sessions of `v41 bench agents`: the seeded workload, what each turn
records, and a run's summary and tables (cluster/bench/agents.py runs it on raylets of
this machine, cluster/bench/agents_hosts.py across namespace hosts)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.bench.sse import sse_chunks

_WORDS = ["def", "return", "self", "value", "result", "queue", "event", "handle", "path", "open", "read", "write", "list", "dict", "item", "index", "count", "error", "raise", "try", "except", "import", "from", "class", "with", "as", "for", "in", "if", "else", "while", "yield", "async", "await", "lambda", "None", "True", "False", "print", "len", "range", "str", "int", "float", "bytes", "json", "load", "dump", "config", "node", "store", "cache", "chunk", "window"]
_TOOLS = [
    {"name": name, "description": f"{name.replace('_', ' ')} in the repository",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "pattern": {"type": "string"},
                                                    "limit": {"type": "integer"}}, "required": ["path"]}}
    for name in ("read_file", "write_file", "list_directory", "search_code", "run_tests", "apply_patch")
]
SYSTEM = ("You are a coding agent. Call one tool per turn; answer with the tool call.\n"
          "Tools:\n" + json.dumps(_TOOLS, indent=1))
_DEPTHS = (1024, 2048, 4096, 8192, 16384)


@dataclass
class Turn:
    depth: int  # prompt tokens
    ttft_ms: float
    cached: int
    reusable: int  # what the previous turn left computed (0 on a session's first turn)
    immediate: bool  # sent with no pause after the previous answer
    moved_bytes: int
    completion: int
    prefilled_by: str  # "resident" (from the decoder's kept cache), "decoder" or "pool"
    queue_ms: float  # waited for a place in a decoder batch (x-v41-queue-ms)
    answer_ms: float  # sent to last token
    stages: dict  # the trip to the first token, stage by stage (ms; the router's Server-Timing)
    recomputed: int = 0  # stored tokens encoded again: moving them from their node would have cost more


def _text(rng: random.Random, words: int) -> str:
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(_WORDS))
        if len(line) == 12:
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines + [" ".join(line)])


class _Agent:
    """One agent session: its history and what its last turn left computed."""

    def __init__(self, number: int, seed: int, start_words: int):
        self.rng = random.Random(seed * 1000 + number)
        self.messages = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Task {number}: fix the failing test.\n"
                                                     f"read_file result:\n{_text(self.rng, start_words)}"}]
        self.reusable = 0
        self.immediate = False


async def _turn(session, url: str, model: str, agent: _Agent, args) -> Turn | None:
    """Send the agent's history; record the turn; append the answer and a tool result."""
    from cluster.serving.timing import parse_server_timing  # (the Serve app's module: not at `v41` start-up)

    body = {"model": model, "messages": agent.messages, "max_tokens": args.max_tokens, "temperature": 0.7,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, usage, answer = None, None, []
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            await response.read()
            return None
        moved = int(response.headers.get("x-v41-moved-bytes", 0))
        recomputed = int(response.headers.get("x-v41-recomputed-tokens", 0))
        source = response.headers.get("x-v41-prefilled-by", "")
        queued = float(response.headers.get("x-v41-queue-ms", 0.0))
        stages, _ = parse_server_timing(response.headers.get("server-timing", ""))
        async for chunk in sse_chunks(response):
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):  # the first chunk (the role) comes with the first token
                first = first or time.perf_counter()
                answer.append(chunk["choices"][0]["delta"].get("content") or "")
    turn = Turn(usage["prompt_tokens"], 1e3 * ((first or time.perf_counter()) - sent),
                usage["prompt_tokens_details"]["cached_tokens"], agent.reusable, agent.immediate, moved,
                usage["completion_tokens"], source, queued, 1e3 * (time.perf_counter() - sent), stages, recomputed)
    agent.reusable = turn.depth + turn.completion - 1
    agent.messages += [{"role": "assistant", "content": "".join(answer)},
                       {"role": "user", "content": f"tool result:\n{_text(agent.rng, agent.rng.randint(50, 500))}"}]
    return turn


async def _loop(session, url: str, model: str, agent: _Agent, stop_at: float, args, turns: list) -> None:
    """Returning turns until the time is up or the history is ``--depth`` deep."""
    while time.monotonic() < stop_at and agent.reusable < args.depth:
        agent.immediate = agent.rng.random() < 0.4
        if not agent.immediate:
            await asyncio.sleep(agent.rng.uniform(0.0, 2.0))
        turn = await _turn(session, url, model, agent, args)
        turns.append(turn)
        if turn is None:
            return



async def run_workload(url: str, model: str, args) -> tuple[list, float]:
    """Every agent's first turn (its task and the file it read: cold, not measured),
    then ``--seconds`` of returning turns, all agents at once."""
    import aiohttp

    rng = random.Random(args.seed)
    agents = [_Agent(i, args.seed, rng.choice((300, 1500, 4000, 8000, 15500))) for i in range(args.sessions)]
    turns: list = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=connector) as session:
        await asyncio.gather(*(_turn(session, url, model, agent, args) for agent in agents))
        started = time.monotonic()
        await asyncio.gather(*(_loop(session, url, model, agent, started + args.seconds, args, turns)
                               for agent in agents))
        return turns, time.monotonic() - started


def _bucket(depth: int) -> str:
    label = _DEPTHS[0]
    for edge in _DEPTHS:
        if depth >= edge:
            label = edge
    return f"{label // 1024}K"


def turn_summary(turns: list, elapsed: float, hits: dict[str, int]) -> dict:
    done = [t for t in turns if t is not None]
    returning = [t for t in done if t.reusable]
    immediate = [t for t in returning if t.immediate]
    by_depth = {}
    for label in (f"{d // 1024}K" for d in _DEPTHS):
        rows = [t for t in returning if _bucket(t.depth) == label]
        if rows:
            by_depth[label] = {"turns": len(rows),
                               "ttft_p50_ms": round(float(np.percentile([t.ttft_ms for t in rows], 50)), 1),
                               "ttft_p99_ms": round(float(np.percentile([t.ttft_ms for t in rows], 99)), 1),
                               "cached_fraction": round(sum(t.cached for t in rows) / max(1, sum(t.depth for t in rows)),
                                                        4)}
    return {
        "turns": len(done), "failed": len(turns) - len(done), "returning_turns": len(returning),
        "immediate_turns": len(immediate),
        "immediate_turn_cached_fraction": round(sum(min(t.cached, t.reusable) for t in immediate)
                                                / max(1, sum(t.reusable for t in immediate)), 4),
        "returning_turn_cached_fraction": round(sum(min(t.cached, t.reusable) for t in returning)
                                                / max(1, sum(t.reusable for t in returning)), 4),
        "reprefilled_tokens": sum(max(0, t.reusable - t.cached) for t in returning),
        # Where returning turns found their conversation: the decoder replica that kept
        # it ("resident"), else the stores (encoded by the pool, or by a decoder).
        "returning_turns_prefilled_by": dict(sorted(Counter(t.prefilled_by for t in returning).items())),
        "resident_fraction": round(sum(t.prefilled_by == "resident" for t in returning) / max(1, len(returning)), 4),
        "ttft_p50_ms": round(float(np.percentile([t.ttft_ms for t in returning], 50)), 1) if returning else None,
        "queue_p50_ms": round(float(np.percentile([t.queue_ms for t in returning], 50)), 1) if returning else None,
        "answer_p50_ms": round(float(np.percentile([t.answer_ms for t in returning], 50)), 1) if returning else None,
        "stages_p50_ms": {name: round(float(np.percentile([t.stages.get(name, 0.0) for t in returning], 50)), 1)
                          for name in dict.fromkeys(name for t in returning for name in t.stages)},
        "by_depth": by_depth,
        "moved_mb": round(sum(t.moved_bytes for t in done) / 1e6, 2),
        # Returning turns whose cache was on another node: moved, or encoded again (cheaper by measured cost).
        "turns_moved": sum(t.moved_bytes > 0 for t in returning),
        "turns_recomputed": sum(t.recomputed > 0 for t in returning),
        "decode_tokens_per_s": round(sum(t.completion for t in done) / elapsed, 1),
        "store_hits_by_tier": hits,
    }


def print_tables(model: Path, args, results: dict, where: str) -> dict:
    """Print the policies' tables (``where``: the cluster, in words); return the JSON summary."""
    print(f"v41 bench agents: {model}, {args.sessions} sessions, {where} x (1 prefill + 1 decoder), "
          f"{args.seconds:.0f} s per policy")
    print(f"{'policy':<12} {'turns':>6} {'failed':>6} {'immediate cached':>16} {'returning cached':>16} "
          f"{'re-prefilled':>12} {'resident':>8} {'TTFT p50 ms':>11} {'queue p50':>9} {'answer p50':>10} "
          f"{'moved MB':>8} {'decode tok/s':>12}  store hits by tier")
    for policy, row in results.items():
        print(f"{policy:<12} {row['turns']:>6} {row['failed']:>6} {row['immediate_turn_cached_fraction']:>16.4f} "
              f"{row['returning_turn_cached_fraction']:>16.4f} {row['reprefilled_tokens']:>12} "
              f"{row['resident_fraction']:>8.3f} {row['ttft_p50_ms'] or 0:>11.1f} {row['queue_p50_ms'] or 0:>9.1f} "
              f"{row['answer_p50_ms'] or 0:>10.1f} {row['moved_mb']:>8.2f} "
              f"{row['decode_tokens_per_s']:>12.1f}  {row['store_hits_by_tier']}")
    print("\nreturning turns' trip to the first token, p50 of each stage (ms)")
    for policy, row in results.items():
        print(f"{policy:<12} " + " ".join(f"{name} {ms:.0f}" for name, ms in row["stages_p50_ms"].items()))
    print("\nreturning turns by depth: turns, TTFT p50 / p99 ms, cached fraction")
    for policy, row in results.items():
        cells = [f"{label} {cell['turns']}: {cell['ttft_p50_ms']:.0f} / {cell['ttft_p99_ms']:.0f}, "
                 f"{cell['cached_fraction']:.3f}" for label, cell in row["by_depth"].items()]
        print(f"{policy:<12} " + " | ".join(cells))
    summary = {"policies": results}
    first = next(iter(results.values()), None)
    if first is not None:
        summary["immediate_turn_cached_fraction"] = first["immediate_turn_cached_fraction"]
        summary["ttft_p50_ms_by_depth"] = {label: cell["ttft_p50_ms"] for label, cell in first["by_depth"].items()}
    if "affinity" in results and "pow2" in results and results["pow2"]["ttft_p50_ms"]:
        summary["affinity_over_pow2_ttft_p50"] = round(results["affinity"]["ttft_p50_ms"]
                                                       / results["pow2"]["ttft_p50_ms"], 3)
        print(f"\naffinity / pow2 TTFT p50 (returning turns): {summary['affinity_over_pow2_ttft_p50']:.3f}")
    return summary
