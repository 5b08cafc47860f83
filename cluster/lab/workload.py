"""Workloads for the retention lab: real request traces and seeded synthetic sessions.

A workload is a time-ordered stream of :class:`Request`: when it arrives, its prompt's
full chunks (``CHUNK_TOKENS`` tokens each, the store's unit) as runs of chunk ids, its
prompt and answer lengths, and the session it belongs to (-1 when the trace does not
say). A chunk's id is (owner, index): two requests share a chunk exactly when they share
the prompt prefix up to its end. Streams are generators: a synthetic workload of a
million sessions is never held in memory.

- :func:`mooncake` reads the Mooncake traces (FAST '25; one JSON object per line with
  ``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``), with
  ``stretch`` (timestamps x k) and ``tile`` (n copies one after another, fresh block ids
  except the shared roots: block ids that start more than one request, like a system
  prompt, stay shared across copies).
- :func:`cluster.lab.sessions.synthetic` draws sessions from a :class:`Profile`
  (``chat``, ``agent``, ``mixed``, or any JSON/YAML file of its fields): arrivals with
  a daily cycle, a lognormal number of turns, a prompt that grows by each answer and
  the next message, gaps of seconds (tool calls) or minutes (people), returns after
  hours (some past 72 h), shared system prompts drawn from a Zipf law, and forks (a
  turn that continues an earlier point of its session).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

TRACES = Path(__file__).resolve().parents[2] / "configs" / "traces"
CONVERSATION_TRACE = TRACES / "mooncake_conversation_trace.jsonl.gz"
SYNTHETIC_TRACE = TRACES / "mooncake_synthetic_trace.jsonl.gz"
BLOCK_TOKENS = 512  # a Mooncake hash id stands for 512 tokens
CHUNK_TOKENS = 128  # the store's chunk: four per trace block


Run = tuple[int, int, int]  # (owner, first index, end index): the chunks (owner, i), first <= i < end
WindowId = tuple[int, int]  # (owner of the last token before it, its position in tokens)
Lineage = tuple[tuple[int, int], ...]  # a prompt's segments: (owner, first token it owns), by position


class Request(NamedTuple):
    """One request (a named tuple: a million-session run builds ~27M of them, and a
    tuple is built in a third of a frozen dataclass's time, in less memory).

    runs: its prompt's full chunks, in order, as runs.
    after: the chunks its answer completes (the conversation's full chunks after the
        answer that are not the prompt's), as runs.
    window: the window state stored after the answer.
    resume: the window state its prompt continues from (an earlier turn's end), if any.
    done_s: when its turn ended, where that was measured (a replay against a live
        cluster); None: the simulator's service time model decides.
    """

    time_s: float
    runs: tuple[Run, ...]
    input_tokens: int
    output_tokens: int
    session: int = -1
    after: tuple[Run, ...] = ()
    window: WindowId | None = None
    resume: WindowId | None = None
    done_s: float | None = None

    @property
    def chunks(self) -> int:
        return sum(end - first for _, first, end in self.runs)

    def chunk_ids(self) -> list[tuple[int, int]]:
        return [(owner, i) for owner, first, end in self.runs for i in range(first, end)]


# ---------------------------------------------------------------------- traces


def read_trace(path: str | Path) -> list[dict]:
    """The rows of a Mooncake trace file (JSONL, gzipped or not)."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def mooncake(path: str | Path, stretch: float = 1.0, tile: int = 1) -> Iterator[Request]:
    """The requests of a Mooncake trace, in time order (see the module docstring)."""
    return trace_requests(read_trace(path), stretch, tile)


def trace_requests(rows: list[dict], stretch: float = 1.0, tile: int = 1,
                   done_s: list[float] | None = None) -> Iterator[Request]:
    """Requests from Mooncake trace rows (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids``); ``done_s``: each row's measured end (a replay)."""
    if stretch <= 0 or tile < 1:
        raise ValueError("stretch must be positive and tile at least 1")
    if not rows:
        return
    firsts: dict[int, int] = {}
    for row in rows:
        if row["hash_ids"]:
            firsts[row["hash_ids"][0]] = firsts.get(row["hash_ids"][0], 0) + 1
    roots = {block for block, count in firsts.items() if count > 1}
    span = max(block for row in rows for block in row["hash_ids"]) + 1
    duration_s = (max(row["timestamp"] for row in rows) + 1) / 1000.0
    per_block = BLOCK_TOKENS // CHUNK_TOKENS
    for copy in range(tile):
        offset = copy * span
        for n, row in enumerate(rows):
            ids = row["hash_ids"]
            prompt, output = int(row["input_length"]), int(row["output_length"])
            full = prompt // CHUNK_TOKENS  # the last block may be partial
            runs = tuple((b if (b in roots and i == 0) else b + offset, 0, min(per_block, full - i * per_block))
                         for i, b in enumerate(ids) if full > i * per_block)
            # The answer is this request's own: no later request of the trace holds it.
            own = -2 - (copy * len(rows) + n)
            end = prompt + output
            after = ((own, full, end // CHUNK_TOKENS),) if end // CHUNK_TOKENS > full else ()
            yield Request((copy * duration_s + row["timestamp"] / 1000.0) * stretch, runs, prompt, output,
                          after=after, window=(own, end), done_s=None if done_s is None else done_s[n])


# ---------------------------------------------------------------------- synthetic sessions


class LogNormal(BaseModel):
    """A lognormal by its median and the sigma of its log."""

    model_config = ConfigDict(extra="forbid")
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)

    def draw(self, rng: np.random.Generator) -> float:
        return float(self.median * math.exp(self.sigma * rng.standard_normal()))


class Profile(BaseModel):
    """Every parameter of a synthetic workload (times in seconds unless named)."""

    model_config = ConfigDict(extra="forbid")
    name: str = "custom"
    sessions: int = Field(1000, ge=1)
    hours: float = Field(24.0, gt=0, description="session starts spread over this many hours")
    daily_amplitude: float = Field(0.5, ge=0, lt=1, description="arrival rate x (1 + a sin(2 pi t / 24 h))")
    turns: LogNormal = LogNormal(median=4, sigma=0.8)
    max_turns: int = Field(200, ge=1)
    first_message_tokens: LogNormal = LogNormal(median=600, sigma=1.0)
    message_tokens: LogNormal = LogNormal(median=120, sigma=1.0)
    output_tokens: LogNormal = LogNormal(median=350, sigma=0.8)
    tool_share: float = Field(0.0, ge=0, le=1, description="turns whose gap is a tool call")
    tool_gap_s: LogNormal = LogNormal(median=3, sigma=0.7)
    human_gap_s: LogNormal = LogNormal(median=90, sigma=1.2)
    return_share: float = Field(0.15, ge=0, le=1, description="turns after which the user comes back hours later")
    return_gap_hours: LogNormal = LogNormal(median=8, sigma=1.3)
    system_prompts: int = Field(50, ge=1)
    system_zipf: float = Field(1.1, gt=1)
    system_tokens: LogNormal = LogNormal(median=1500, sigma=0.6)
    fork_share: float = Field(0.03, ge=0, le=1, description="turns that continue an earlier point of the session")
    max_prompt_tokens: int = Field(131072, ge=CHUNK_TOKENS)
    # A turn's answer takes (prompt / prefill rate + answer / decode rate) at most; the
    # next message comes that long plus its gap after the turn arrived (the simulator's
    # service times use the same rates, so a turn never arrives before the last one ended).
    prefill_tokens_per_s: float = Field(20000.0, gt=0)
    decode_tokens_per_s: float = Field(50.0, gt=0)
    seed: int = 0

    @classmethod
    def named(cls, name: str, **overrides) -> Profile:
        if name not in PROFILES:
            raise ValueError(f"unknown profile {name!r}; expected one of {', '.join(PROFILES)}")
        return cls.model_validate({**PROFILES[name], "name": name, **overrides})

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> Profile:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        base = PROFILES.get(data.get("profile", ""), {})
        data.pop("profile", None)
        return cls.model_validate({**base, **data, **overrides})


# Chat: people, minutes between turns. Agent: tool loops, seconds between turns, long
# growing prompts, more returns. Mixed: both kinds of session in one stream.
PROFILES: dict[str, dict] = {
    "chat": {"tool_share": 0.0, "turns": {"median": 4, "sigma": 0.8}, "return_share": 0.10},
    "agent": {"tool_share": 0.85, "turns": {"median": 20, "sigma": 0.9}, "first_message_tokens":
              {"median": 2000, "sigma": 1.0}, "message_tokens": {"median": 400, "sigma": 1.2},
              "output_tokens": {"median": 150, "sigma": 0.9}, "return_share": 0.02, "fork_share": 0.05},
    "mixed": {"tool_share": 0.5, "turns": {"median": 8, "sigma": 1.0}, "return_share": 0.06},
}
