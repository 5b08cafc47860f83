"""How many guesses of each request a speculative step verifies: the cost table and the scheduler.

SPS(B): the paper profiles one curve over the batch's token count B. This engine runs
attention per sequence, so a step's cost depends on the number of requests R as well
as on B; :class:`StepCost` is a table over (R, tokens per request), read at the current
R — at fixed R it is the paper's curve. It times a whole speculative step (the draft
pass plus the verify pass), so the throughput the scheduler maximises is tokens per
second of wall clock.

:func:`schedule` is Algorithm 1 of the DSpark paper (the hardware-aware prefix
scheduler) on that table; :func:`replay_schedules` scores choices of verify lengths on
recorded draft states, without the machine's noise.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .cache import SequenceCache
from .engine import Engine
from .sampling import SamplingParams
from .speculative import SpeculativeDrafter

MODES = ("off", "fixed", "scheduled")
"""The batcher's speculation modes: plain decoding, a fixed k, :func:`schedule`."""


class StepCost:
    """Seconds per speculative step as a table over (requests R, tokens per request t).

    ``seconds[(R, t)]``: one step of R requests that each verify t tokens (anchor +
    t - 1 guesses), draft pass included. :meth:`sps` reads steps per second at R
    requests and B batch tokens, linear between table points (and beyond the largest
    R, proportional to R).

    ``padding[R]``: seconds per padded slot at R requests. A step whose requests verify
    different counts lays its tokens out [R, longest] to read the caches once over the
    batch, so each shorter request's tail is computed on and dropped: such a step costs
    the table's time for its tokens plus ``padding[R]`` per slot of ``R * longest -
    tokens`` (measured on configs/small's compiled step at R = 16: a padded slot costs
    about half a token in a batch of mixed lengths; see :meth:`profile`).
    """

    def __init__(self, seconds: dict[tuple[int, int], float], padding: dict[int, float] | None = None):
        if not seconds:
            raise ValueError("an empty step-cost table")
        self.seconds = dict(seconds)
        self.padding = dict(padding or {})
        self.requests = sorted({r for r, _ in seconds})
        # Each R's t points and seconds as arrays, once: the scheduler reads the table for
        # every admission of a step at once (:meth:`seconds_per_steps`).
        self._ts = {r: np.array(sorted(t for rr, t in seconds if rr == r), dtype=np.float64) for r in self.requests}
        self._s = {r: np.array([seconds[(r, int(t))] for t in ts]) for r, ts in self._ts.items()}
        self.max_tokens = {r: int(ts[-1]) for r, ts in self._ts.items()}

    def _at(self, r: int, t: np.ndarray) -> np.ndarray:
        """Seconds at R = ``r`` for t tokens per request, linear between table points
        (clamped to the table's t range)."""
        return np.interp(t, self._ts[r], self._s[r])

    def seconds_per_step(self, requests: int, tokens: int, longest: int | None = None) -> float:
        """One step of ``requests`` requests verifying ``tokens`` in all, the longest
        ``longest`` of them (None: as many each)."""
        return float(self.seconds_per_steps(requests, np.array([tokens]),
                                            None if longest is None else np.array([longest]))[0])

    def seconds_per_steps(self, requests: int, tokens: np.ndarray, longest: np.ndarray | None = None) -> np.ndarray:
        """:meth:`seconds_per_step` for many token counts (and longest verifies) at once."""
        base = self._per_token(requests, tokens)
        if longest is None or not self.padding:
            return base
        return base + self._padding_rate(requests) * np.maximum(0, requests * longest - tokens)

    def _padding_rate(self, requests: int) -> float:
        rs = sorted(self.padding)
        if requests <= rs[0] or requests >= rs[-1]:
            return self.padding[rs[0] if requests <= rs[0] else rs[-1]]
        i = bisect.bisect_left(rs, requests)
        lo, hi = rs[i - 1], rs[i]
        w = (requests - lo) / (hi - lo)
        return (1 - w) * self.padding[lo] + w * self.padding[hi]

    def _per_token(self, requests: int, tokens: np.ndarray) -> np.ndarray:
        t = tokens / requests
        rs = self.requests
        if requests >= rs[-1]:
            return self._at(rs[-1], t) * requests / rs[-1]
        if requests <= rs[0]:
            return self._at(rs[0], t)
        i = bisect.bisect_left(rs, requests)
        hi = rs[i]
        if hi == requests:
            return self._at(hi, t)
        lo = rs[i - 1]
        w = (requests - lo) / (hi - lo)
        return (1 - w) * self._at(lo, t) + w * self._at(hi, t)

    def sps(self, requests: int, tokens: int, longest: int | None = None) -> float:
        """Steps per second with ``requests`` requests and ``tokens`` batch tokens (the
        longest request's ``longest``)."""
        return 1.0 / self.seconds_per_step(requests, tokens, longest)

    def to_dict(self) -> dict:
        return {**{f"{r}x{t}": round(s, 6) for (r, t), s in sorted(self.seconds.items())},
                **{f"padding@{r}": round(s, 7) for r, s in sorted(self.padding.items())}}

    @classmethod
    def profile(cls, engine: Engine, drafter: SpeculativeDrafter | None, requests: Sequence[int] = (1, 2, 4, 8, 16),
                max_tokens: int = 6, context: int = 96, rounds: int = 8, seed: int = 0) -> "StepCost":
        """Time real draft + verify + accept steps on synthetic caches (random entries in
        the real formats, full windows; a step's cost does not depend on the values).

        For each R: ``rounds`` rounds of steps verifying 1, 2, ..., T tokens per request
        back to back, in alternating order (ascending, then descending: :func:`profile_order`);
        the table at t is the median one-token step plus the median, over rounds, of
        the t-token step less the same round's one-token step (never falling with t).
        Differences within a round are what make the rise measurable: on a shared
        2-core machine one step of 16 requests varies by ~15% from the next, more than
        verifying six tokens instead of one costs at small R; a line fitted through
        per-t medians moved between 0 and +45% from profile to profile, the paired
        difference by a few %. The alternating order cancels a machine that drifts
        while it profiles. Every t is measured because the cost is not a line in t:
        on configs/small's compiled step at R = 1, 11.8 / 12.9 / 14.4 / 13.6 / 14.6 /
        14.3 ms for t = 1..6 (most of the rise by t = 3), at R = 4 a third of it from
        t = 1 to 2; a line through t = 1 and 6 made the scheduler stop at 2-3 guesses
        where verifying all 5 cost about the same.

        For R > 1 each round is followed by a pair of the one-token step and a step
        where half the requests verify ``max_tokens`` and the others one: its median
        difference, less what the table gives those tokens, per padded slot, is
        ``padding[R]``. (Half, not one: a padded slot's cost depends on the layout.
        Measured on configs/small at R = 16, real caches: with one request at 6 tokens
        among fifteen at 1 a padded slot cost 0.22 of a token, with half at 6 0.47, with
        lengths mixed at random 0.54; with each token's cache reads per token since,
        0.17.)"""
        generator = torch.Generator().manual_seed(seed)
        seconds, padding = {}, {}
        for r in requests:
            caches = [synthetic_cache(engine, context, generator) for _ in range(r)]
            contexts = None
            if drafter is not None:  # a fixed context: the draft's cost does not depend on it
                feats = [torch.randn(drafter.window, len(drafter.targets), engine.config.hc_mult,
                                     engine.config.hidden_size, generator=generator) for _ in range(r)]
                pos = [torch.arange(context - drafter.window, context) for _ in range(r)]
                contexts = drafter.extend([None] * r, feats, pos)
            greedy = [SamplingParams(temperature=0.0)] * r
            long = max(1, r // 2)  # the requests of the padded step that verify max_tokens

            def step(t: int, skewed: bool = False) -> float:
                start = time.perf_counter()
                if contexts is not None:
                    drafter.propose(contexts, [5] * r, greedy, [None] * r)
                counts = [t if i < long or not skewed else 1 for i in range(r)]
                _, rewinds = engine.verify([(c, [5] * n) for c, n in zip(caches, counts)])
                for c, rw in zip(caches, rewinds):
                    engine.accept(c, rw, 1)  # the context grows by one token a step
                return time.perf_counter() - start

            step(max_tokens)  # warm-up
            ones, rises, skews = [], {t: [] for t in range(2, max_tokens + 1)}, []
            for order in profile_order(max_tokens, rounds):
                times = {t: step(t) for t in order}
                ones.append(times[1])
                for t, rise in rises.items():
                    rise.append(times[t] - times[1])
                if r > 1:  # half the requests verifying max_tokens, the others 1 (padding), paired
                    if len(skews) % 2:
                        one = step(1)
                        skews.append(step(max_tokens, skewed=True) - one)
                    else:
                        lopsided = step(max_tokens, skewed=True)
                        skews.append(lopsided - step(1))
            base, top = statistics.median(ones), 0.0
            seconds[(r, 1)] = base
            for t, rise in rises.items():
                top = max(top, statistics.median(rise))  # verifying more never costs less
                seconds[(r, t)] = base + top
            if skews:  # what the padded step costs past what the table gives its tokens, per padded slot
                tokens = r + long * (max_tokens - 1)
                tokens_rise = cls(seconds).seconds_per_step(r, tokens) - base
                padding[r] = max(0.0, statistics.median(skews) - tokens_rise) / ((r - long) * (max_tokens - 1))
        return cls(seconds, padding)


def profile_order(max_tokens: int, rounds: int) -> list[list[int]]:
    """The profile's rounds of steps: 1, 2, ..., T and T, ..., 2, 1 in turns."""
    ascending = list(range(1, max_tokens + 1))
    return [ascending if i % 2 == 0 else ascending[::-1] for i in range(rounds)]


def synthetic_cache(engine: Engine, context: int, generator: torch.Generator) -> SequenceCache:
    """A cache of ``context`` positions with random long-range entries and full windows."""
    config = engine.config
    cache = engine.new_cache()
    for plan in config.layer_plans():
        if plan.is_kv_source:
            n = context // plan.compress_ratio
            cache.entries[plan.index].append(torch.randn(n, config.head_dim, generator=generator))
            cache.keys[plan.index].append(torch.randn(n, config.index_head_dim, generator=generator))
            cache.pending[plan.index] = torch.randn(context % plan.compress_ratio, config.hidden_size,
                                                    generator=generator)
    for layer in range(config.num_hidden_layers):
        window = cache.new_window(layer, context - config.sliding_window)
        window.rows.append(torch.randn(config.sliding_window, config.head_dim, generator=generator))
    cache.length = context
    return cache


def schedule(survival: torch.Tensor, cost: StepCost) -> list[int]:
    """Algorithm 1 (hardware-aware prefix scheduler) with its early stop.

    ``survival`` [R, K]: a_{r,j} = prod_{i<=j} c_{r,i}. Candidates (r, j) are admitted in
    descending a (ties: earlier j first, so a request's prefix is admitted in order);
    each admission adds one batch token and a_{r,j} expected tokens; the first admission
    that does not raise tau * SPS(R, B) stops the search. Returns verify lengths l_r.

    With a padding cost (:class:`StepCost`), SPS also counts the slots the longest
    verify pads in every other request. Then the first admission at a new depth pays
    for a whole layer of padding that the admissions after it fill for the price of
    their tokens alone, so throughput along the order dips and rises again; the early
    stop would end at the first dip (measured: at batch 16 it verified nothing in 63%
    of the slots and lost 16% to a fixed k). There the search runs the whole order and
    returns its best prefix.

    Every admission's throughput is computed at once (numpy over the R * K candidates):
    the same choice as admitting them one by one, which took ~0.3 ms a step at R = 16,
    K = 5, about 1% of the step.
    """
    r_count, k = survival.shape
    # Survival never rises along j (a product of probabilities; the running minimum
    # makes it so for any input), so with ties taken in j order each request's guesses
    # are admitted as a prefix.
    a = np.minimum.accumulate(survival.detach().double().numpy(), axis=1).ravel()
    candidates = np.flatnonzero(a > 0)
    order = candidates[np.lexsort((candidates // k, candidates % k, -a[candidates]))]  # by -a, then j, then r
    values, js, rs = a[order], order % k, order // k
    n = len(order)
    tokens = r_count + np.arange(1, n + 1)
    expected = np.cumsum(np.concatenate(([float(r_count)], values)))[1:]  # summed in order, as one by one
    longest = np.maximum.accumulate(js + 2)  # a verify length: the anchor and j + 1 guesses
    throughput = expected * (1.0 / cost.seconds_per_steps(r_count, tokens, longest))
    best = r_count * (1.0 / cost.seconds_per_step(r_count, r_count, 1))
    if cost.padding:  # the best prefix of the whole order
        admitted = int(throughput.argmax()) + 1 if n and throughput.max() > best else 0
    else:  # up to the first admission that does not raise it
        running = np.maximum.accumulate(np.concatenate(([best], throughput)))[:-1]
        stops = np.flatnonzero(throughput <= running)
        admitted = int(stops[0]) if len(stops) else n
    return np.bincount(rs[:admitted], minlength=r_count).tolist()


@dataclass
class VerifyRecord:
    """One speculative step as the scheduler saw it and as verification came out:
    ``survival`` [R, K] (the drafter's a_{r,j}, 0 past a request's room), the guesses
    each request had ``room`` for (its length limit, at most K), and the guesses
    ``verified`` and ``accepted`` [R]."""

    survival: np.ndarray
    room: np.ndarray
    verified: np.ndarray
    accepted: np.ndarray


def replay_schedules(records: Sequence[VerifyRecord], cost: StepCost, fixed: Sequence[int]) -> dict[str, float]:
    """Tokens per second, by ``cost``, of each way of choosing verify lengths on the
    same draft states: every fixed k of ``fixed``, :func:`schedule`, and an oracle that
    verifies exactly the guesses that will be accepted.

    ``records`` must come from steps that verified every guess a request had room for
    (a fixed k of the drafter's block size), so that any shorter choice's accepted
    count is known: ``min(accepted, length)`` (a greedy or rejection-sampled prefix).
    Noise-free (the table's time, not the machine's) and free of the trajectory (every
    choice sees the same states; in a real run a choice changes which requests are
    still running and where), it measures the choices alone."""
    def score(choose) -> float:
        tokens = seconds = 0.0
        for record in records:
            r = len(record.accepted)
            if np.any(record.verified < record.room):
                raise ValueError("a record that did not verify every guess with room")
            lengths = np.minimum(np.asarray(choose(record), dtype=np.int64), record.room)
            tokens += float((1 + np.minimum(record.accepted, lengths)).sum())
            seconds += cost.seconds_per_step(r, int(r + lengths.sum()), int(lengths.max()) + 1)
        return tokens / seconds

    out = {f"k={k}": score(lambda record, k=k: np.full(len(record.accepted), k)) for k in fixed}
    out["scheduler"] = score(lambda record: schedule(torch.from_numpy(record.survival), cost))
    out["oracle"] = score(lambda record: record.accepted)
    return out
