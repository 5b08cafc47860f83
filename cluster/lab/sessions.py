"""The synthetic workload's sessions: the requests of a ``workload.Profile``'s sessions.

A module of its own, without pydantic, so that ``cluster.lab.native`` compiles it
with the simulator (a tenth of a scale-mode run's time is here). The profile it reads
is ``workload.Profile``.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import numpy as np

from cluster.lab.workload import CHUNK_TOKENS, Lineage, LogNormal, Profile, Request, Run, WindowId


def _owner(*parts: int) -> int:
    """A 62-bit owner id for a synthetic prompt part (apart from small trace ids)."""
    digest = hashlib.blake2b(b"".join(p.to_bytes(8, "little", signed=True) for p in parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2 | 1 << 61


@dataclass(slots=True)
class _Session:
    index: int
    turns_left: int
    system: int  # which system prompt
    system_tokens: int
    lineage: Lineage  # never changed (a fork makes a new one): earlier turns' ends share it
    tokens: int  # prompt length of the next turn (system + history + new message)
    ends: list[tuple[int, Lineage]]  # each earlier turn's end and lineage, for forks
    branches: int = 0
    resume: WindowId | None = None


class _Agenda:
    """Sessions by the time of their next turn, earliest first; sessions due at the same
    time in session order (as a heap of (time, index, session) gave them). A heap of
    bare times and the sessions due at each: a float comparison costs a fraction of a
    tuple's, and a pop makes ~2 log2(n) of them (~5 us of a million-session run's ~75
    per request went to the tuple heap)."""

    __slots__ = ("_due", "_times")

    def __init__(self) -> None:
        self._times: list[float] = []
        self._due: dict[float, _Session | list[_Session]] = {}

    def __bool__(self) -> bool:
        return bool(self._times)

    def push(self, time_s: float, session: _Session) -> None:
        due = self._due.get(time_s)
        if due is None:
            self._due[time_s] = session
            heapq.heappush(self._times, time_s)
        elif isinstance(due, list):
            due.append(session)
        else:
            self._due[time_s] = [due, session]

    def pop(self) -> tuple[float, _Session]:
        time_s = self._times[0]
        due = self._due[time_s]
        if not isinstance(due, list):
            heapq.heappop(self._times)
            del self._due[time_s]
            return time_s, due
        first = min(due, key=lambda session: session.index)
        due.remove(first)
        if len(due) == 1:
            self._due[time_s] = due[0]
        return time_s, first


def _zipf_table(n: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return np.cumsum(weights / weights.sum())


def synthetic(profile: Profile) -> Iterator[Request]:
    """The requests of ``profile``'s sessions, in time order (seeded: the same profile
    gives the same stream)."""
    rng = np.random.default_rng(profile.seed)
    zipf = _zipf_table(profile.system_prompts, profile.system_zipf)
    system_lengths = [max(1, int(profile.system_tokens.draw(rng))) for _ in range(profile.system_prompts)]
    starts = _arrivals(rng, profile.sessions, profile.hours * 3600.0, profile.daily_amplitude)
    # Each session's opening draws, in session order; a session is built when it starts
    # and let go when it ends (a million sessions' histories would hold gigabytes).
    openings: list[tuple[int, int, int] | None] = []
    for _ in range(profile.sessions):
        system = int(np.searchsorted(zipf, rng.random()))
        turns = min(profile.max_turns, max(1, round(profile.turns.draw(rng))))
        openings.append((system, turns, max(1, int(profile.first_message_tokens.draw(rng)))))

    def session(index: int) -> _Session:
        system, turns, first_message = cast(tuple[int, int, int], openings[index])
        openings[index] = None
        tokens = system_lengths[system]
        # The chunks wholly inside the system prompt are shared by every session using it.
        lineage = ((_owner(-1, system), 0), (_owner(index, 0), tokens))
        return _Session(index, turns, system, tokens, lineage, tokens + first_message, [])

    # The agenda holds the started sessions and the next to start (one of every session
    # made each pop cost log2 of the whole population).
    agenda = _Agenda()
    if profile.sessions:
        agenda.push(float(starts[0]), session(0))
    started = 0  # sessions whose first turn has been taken
    # The loop's draws and constants, bound once (the same arithmetic as LogNormal.draw).
    random = rng.random
    draw_output, draw_message, draw_return, draw_tool, draw_human = (
        _drawer(d, rng) for d in (profile.output_tokens, profile.message_tokens, profile.return_gap_hours,
                                  profile.tool_gap_s, profile.human_gap_s))
    max_prompt, fork_share = profile.max_prompt_tokens, profile.fork_share
    return_share, tool_share = profile.return_share, profile.tool_share
    prefill_rate, decode_rate = profile.prefill_tokens_per_s, profile.decode_tokens_per_s
    while agenda:
        time_s, s = agenda.pop()
        if s.index == started:  # its first turn (sessions start in index order): the next one joins
            started += 1
            if started < profile.sessions:
                agenda.push(float(starts[started]), session(started))
        prompt = min(s.tokens, max_prompt)
        output = max(1, int(draw_output()))
        end = prompt + output
        lineage = s.lineage
        yield Request(time_s, _runs(lineage, 0, prompt // CHUNK_TOKENS), prompt, output, s.index,
                      _runs(lineage, prompt // CHUNK_TOKENS, end // CHUNK_TOKENS), _window(lineage, end), s.resume)
        s.turns_left -= 1
        if s.turns_left <= 0:
            continue
        grown = end
        ends = s.ends
        ends.append((grown, lineage))
        if len(ends) > 1 and random() < fork_share:
            # Continue from an earlier turn's end, on a new branch from there on.
            grown, earlier = ends[int(rng.integers(0, len(ends) - 1))]
            s.branches += 1
            lineage = s.lineage = (*((owner, first) for owner, first in earlier if first < grown),
                                   (_owner(s.index, s.branches), grown))
        s.resume = _window(lineage, grown)
        s.tokens = grown + max(1, int(draw_message()))
        if random() < return_share:
            gap = 3600.0 * draw_return()
        elif random() < tool_share:
            gap = draw_tool()
        else:
            gap = draw_human()
        agenda.push(time_s + (prompt / prefill_rate + output / decode_rate) + gap, s)  # (as it always added)


def _drawer(law: LogNormal, rng: np.random.Generator) -> Callable[[], float]:
    """``law.draw(rng)`` as a closure (the generator's hot path: no attribute look-ups)."""
    median, sigma, normal, exp = law.median, law.sigma, rng.standard_normal, math.exp
    return lambda: median * exp(sigma * normal())


def _arrivals(rng: np.random.Generator, n: int, span_s: float, amplitude: float) -> np.ndarray:
    """``n`` sorted start times in ``[0, span_s)`` from a rate ``1 + a sin(2 pi t / day)``
    (thinning)."""
    out = np.empty(0)
    while out.size < n:
        t = rng.uniform(0, span_s, size=2 * (n - out.size) + 16)
        keep = rng.uniform(0, 1 + amplitude, size=t.size) < 1 + amplitude * np.sin(2 * np.pi * t / 86400.0)
        out = np.concatenate([out, t[keep]])
    return np.sort(out[:n])


def _owner_of(lineage: Lineage, token: int) -> int:
    """The owner of the token at ``token`` (the segment it falls in)."""
    owner = lineage[0][0]
    for candidate, first in lineage:
        if first > token:
            break
        owner = candidate
    return owner


def _runs(lineage: Lineage, lo: int, hi: int) -> tuple[Run, ...]:
    """Chunks ``lo <= i < hi`` of a lineage as runs. A chunk belongs to the owner of its
    last token (that owner's id stands for the whole prefix up to it): a segment owning
    tokens ``[first, next)`` owns the chunks ``[first // C, next // C)``."""
    runs = []
    last = len(lineage) - 1
    for k, (owner, first) in enumerate(lineage):  # (comparisons, not min and max: twice as fast)
        start = first // CHUNK_TOKENS
        if start >= hi:  # segments start in order: none after this one is inside
            break
        if start < lo:  # noqa: PLR1730 (a call to max costs more)
            start = lo
        end = lineage[k + 1][1] // CHUNK_TOKENS if k < last else hi
        if end > hi:  # noqa: PLR1730
            end = hi
        if end > start:
            runs.append((owner, start, end))
    return tuple(runs)


def _window(lineage: Lineage, end: int) -> WindowId:
    return (_owner_of(lineage, end - 1), end)
