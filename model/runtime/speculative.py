"""DSpark speculative decoding: drafting, lossless verification, and the goodput scheduler.

One speculative step for a batch of requests (:class:`model.runtime.batcher.Batcher` drives it):

1. **Draft** (:meth:`SpeculativeDrafter.propose`): every request's anchor (its last
   token, not yet fed) and its drafter context (:class:`DraftContext`: the drafter
   layers' window entries of the last ``sliding_window`` fed positions, made from the
   target layers' attention-input streams) give ``dspark_block_size`` guesses in one
   parallel drafter pass, then the Markov head picks them left to right with the
   request's own sampling parameters; the confidence head gives c_1..c_K, calibrated
   per position by temperature (:class:`Calibration`).
2. **Schedule** (:func:`schedule`): how many guesses of each request to verify.
   ``"scheduled"`` is Algorithm 1 of the DSpark paper with its early stop, on the
   steps-per-second table :class:`StepCost` profiled when the decoder starts;
   ``"fixed"`` verifies k guesses of every request; ``"off"`` decodes plainly.
3. **Verify**: one backbone pass (:meth:`model.runtime.engine.Engine.verify`) over every
   request's ``[anchor, admitted guesses]``; the engine's causal attention handles
   several new tokens per sequence.
4. **Accept** (:func:`accept_tokens`): greedy requests keep guesses while they equal the
   target's argmax, then take the target's token (so greedy output equals plain greedy
   output); sampled requests use rejection sampling against
   :func:`model.runtime.sampling.probabilities` (accept ``x ~ q`` with ``min(1, p(x)/q(x))``, on
   rejection draw from ``norm(max(0, p - q))``, after a fully accepted prefix draw the
   bonus from ``p``), which preserves the target distribution exactly.
5. **Roll back** (:meth:`model.runtime.engine.Engine.accept`) every cache to its kept tokens,
   and extend each drafter context with the kept positions' streams.

SPS(B): the paper profiles one curve over the batch's token count B. This engine runs
attention per sequence, so a step's cost depends on the number of requests R as well
as on B; :class:`StepCost` is a table over (R, tokens per request), read at the current
R — at fixed R it is the paper's curve. It times a whole speculative step (the draft
pass plus the verify pass), so the throughput the scheduler maximises is tokens per
second of wall clock.

No I/O here: calibration temperatures are read and written as dicts by the caller.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..dspark import DSparkDrafter, Proposal
from .cache import SequenceCache
from .engine import Engine, Tap
from .sampling import SamplingParams, probabilities

MODES = ("off", "fixed", "scheduled")


# ---------------------------------------------------------------------- drafter context


@dataclass
class DraftContext:
    """One request's drafter window: per drafter layer the entries [T, head_dim] of the
    last ``sliding_window`` fed positions ``positions`` [T] (oldest first)."""

    entries: list[torch.Tensor]
    positions: torch.Tensor

    @property
    def end(self) -> int:
        """The position after the newest entry (the next anchor's position)."""
        return int(self.positions[-1]) + 1 if self.positions.numel() else 0


class SpeculativeDrafter:
    """A :class:`DSparkDrafter` bound to a backbone: contexts, proposals, calibration."""

    def __init__(self, drafter: DSparkDrafter, engine: Engine, calibration: "Calibration | None" = None):
        self.drafter, self.engine = drafter.eval(), engine
        self.model = engine.model
        self.targets = tuple(drafter.config.dspark_target_layer_ids)
        self.block_size = drafter.block_size
        self.window = drafter.window
        self.calibration = calibration or Calibration.identity(self.block_size)
        if engine.compiled is not None:  # the drafter's layers run compiled too
            engine.compiled.add_blocks(drafter.mtp)

    def tap(self) -> Tap:
        return Tap(self.targets)

    def warm_compiled(self) -> None:
        """Build the compiled drafter's packages (its layer for both MoE forms, its
        attention) with throwaway drafts of one request and of the most the compiled
        step takes, so that no request pays for it. Nothing without a compiled engine."""
        compiled = self.engine.compiled
        if compiled is None:
            return
        config = self.engine.config
        generator = torch.Generator().manual_seed(0)
        for requests in sorted({1, max(1, compiled.max_tokens // self.block_size)}):
            features = [torch.randn(self.window, len(self.targets), config.hc_mult, config.hidden_size,
                                    generator=generator) for _ in range(requests)]
            contexts = self.extend([None] * requests, features, [torch.arange(self.window)] * requests)
            self.propose(contexts, [0] * requests, [SamplingParams(temperature=0.0)] * requests, [None] * requests)

    @torch.no_grad()
    def extend(self, contexts: Sequence[DraftContext | None], features: Sequence[torch.Tensor],
               positions: Sequence[torch.Tensor]) -> list[DraftContext]:
        """Append fed positions to each request's context (one drafter projection for all).

        ``features[i]`` [n_i, n_targets, hc, D] are the target layers' input streams of
        request ``i``'s positions ``positions[i]`` [n_i] (from a :class:`Tap`).
        """
        flat = torch.cat(list(features))[None]  # [1, N, n_targets, hc, D]
        flat_pos = torch.cat(list(positions))[None]
        entries = self.drafter.context_entries(self.drafter.project_context(flat), flat_pos)  # per layer [1, N, hd]
        out, lo = [], 0
        for context, pos in zip(contexts, positions):
            hi = lo + len(pos)
            new = [e[0, lo:hi] for e in entries]
            if context is not None and context.positions.numel():
                if context.end != int(pos[0]):
                    raise ValueError(f"drafter context ends at {context.end}, new positions start at {int(pos[0])}")
                new = [torch.cat((old, e)) for old, e in zip(context.entries, new)]
                pos = torch.cat((context.positions, pos))
            out.append(DraftContext([e[-self.window :] for e in new], pos[-self.window :]))
            lo = hi
        return out

    @torch.no_grad()
    def propose(self, contexts: Sequence[DraftContext], anchors: Sequence[int], params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None], constraints: Sequence | None = None) -> "Drafted":
        """Guesses for every request from one parallel drafter pass.

        The anchor of request ``i`` sits at ``contexts[i].end``. Greedy requests take the
        argmax at each position, sampled ones draw from ``probabilities(logits, params)``
        with their own generator (one uniform per position), so that the draft
        distribution ``q`` used by the rejection sampler is exactly the one drawn from.
        ``constraints[i]`` (a :class:`model.runtime.grammar.Constraint` or None): the
        request's guesses are drawn inside its grammar (the masked distribution is ``q``),
        so the target never rejects a guess for leaving it.
        """
        device = self.model.embed.weight.device
        width = max(len(c.positions) for c in contexts)
        anchor_pos = torch.tensor([c.end for c in contexts], dtype=torch.long, device=device)
        entries, entry_pos = [], torch.empty(len(contexts), width, dtype=torch.long, device=device)
        for layer in range(len(self.drafter.mtp)):
            padded = torch.zeros(len(contexts), width, contexts[0].entries[layer].shape[-1], device=device)
            for i, c in enumerate(contexts):
                padded[i, : len(c.positions)] = c.entries[layer]
            entries.append(padded)
        for i, c in enumerate(contexts):
            # Padding sits at the anchor's own position, which the draft mask excludes.
            entry_pos[i] = anchor_pos[i]
            entry_pos[i, : len(c.positions)] = c.positions
        anchor_ids = torch.tensor(list(anchors), dtype=torch.long, device=device)
        compiled = self.engine.compiled
        run_block = compiled if compiled is not None and compiled.handles(len(contexts) * self.block_size) else None
        draft = self.drafter.draft(entries, entry_pos, anchor_ids, anchor_pos, self.model.embed, self.model.lm_head,
                                   run_block)
        sampled = [not p.greedy for p in params]
        q: list[torch.Tensor] = []

        guided = [i for i, c in enumerate(constraints or ()) if c is not None]
        # Per guided request: the guesses walked so far, and the mask before each of them
        # and after the last one while they stay inside the grammar (what the verify pass
        # needs: GrammarWalk).
        walks = {i: GrammarWalk([], []) for i in guided}
        inside = {i: True for i in guided}

        def pick(step: torch.Tensor) -> torch.Tensor:
            masks = {}
            if guided:
                step = step.float().clone()
                for i in guided:
                    if inside[i]:
                        masks[i] = constraints[i].mask()
                        walks[i].masks.append(masks[i])
                    mask = masks.get(i)
                    if mask is not None and bool(mask.any()):
                        step[i, ~mask[: step.shape[-1]]] = float("-inf")
            tokens = step.argmax(dim=-1)
            if any(sampled):
                probs = probabilities(step, params)
                q.append(probs)
                for i, is_sampled in enumerate(sampled):
                    if is_sampled:
                        tokens[i] = _draw(probs[i], generators[i])
            for i in guided:
                walks[i].tokens.append(int(tokens[i]))
                inside[i] = inside[i] and constraints[i].try_advance(int(tokens[i]), masks[i])
            return tokens

        try:
            proposal = self.drafter.propose(draft, anchor_ids, pick=pick)
            for i in guided:
                if inside[i]:
                    walks[i].masks.append(constraints[i].mask())
        finally:
            for i in guided:
                constraints[i].rewind()
        confidence = self.calibration.apply(proposal.confidence_logits)
        return Drafted(proposal, confidence, confidence.cumprod(dim=-1), torch.stack(q, dim=1) if q else None,
                       walks)


@dataclass
class GrammarWalk:
    """A constrained request's draft path: its guessed ``tokens`` and ``masks`` [V] (None:
    not constrained yet), the one before each guess and the one after the last, while the
    guesses stay inside the grammar (one row past the first that leaves it)."""

    tokens: list[int]
    masks: list[torch.Tensor | None]

    def masks_for(self, guesses: Sequence[int]) -> list[torch.Tensor | None] | None:
        """What ``Constraint.masks_along(guesses)`` gives, from the walk, or None if
        ``guesses`` are not the walk's (a caller changed the proposal)."""
        if list(guesses) != self.tokens[: len(guesses)]:
            return None
        return self.masks[: len(guesses) + 1]


@dataclass
class Drafted:
    """A batch's proposal: ``tokens`` via ``proposal`` [R, K]; calibrated ``confidence`` c
    and ``survival`` a = prod c [R, K]; ``q`` [R, K, V] the draft distributions the
    sampled rows drew from (None when every request is greedy); ``walks`` the grammar
    masks along the guesses of constrained requests."""

    proposal: Proposal
    confidence: torch.Tensor
    survival: torch.Tensor
    q: torch.Tensor | None
    walks: dict[int, GrammarWalk] = field(default_factory=dict)  # by row, for constrained requests


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One inverse-CDF draw from ``probs`` [V] (float64), one uniform from ``generator``."""
    if generator is None:
        raise ValueError("a sampled request needs a generator")
    u = torch.rand((), generator=generator, device=generator.device, dtype=torch.float64).to(probs.device)
    cdf = probs.double().cumsum(-1)
    return int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True).clamp_(max=probs.shape[-1] - 1))


# ---------------------------------------------------------------------- acceptance


def accept_tokens(target_logits: torch.Tensor, guesses: Sequence[int], params: SamplingParams,
                  generator: torch.Generator | None, q: torch.Tensor | None = None) -> tuple[int, list[int]]:
    """Verify one request's guesses; returns (accepted guesses m, emitted tokens: m + 1).

    ``target_logits`` [l + 1, V]: the backbone's logits at the anchor and at each of the
    ``l`` guesses; ``q`` [>= l, V]: the draft distributions the guesses were drawn from
    (sampled requests only).

    Greedy: guess j is kept while it equals the target's argmax (the token plain greedy
    decoding would produce), and the first mismatch is replaced by that argmax.
    Sampled: standard speculative rejection sampling; the output tokens are distributed
    exactly as sampling from ``probabilities(target_logits[j], params)`` one at a time.
    """
    n = len(guesses)
    if target_logits.shape[0] != n + 1:
        raise ValueError(f"{target_logits.shape[0]} target rows for {n} guesses")
    if params.greedy:
        target = target_logits.argmax(dim=-1).tolist()
        m = 0
        while m < n and guesses[m] == target[m]:
            m += 1
        return m, list(guesses[:m]) + [target[m]]
    if q is None or q.shape[0] < n:
        raise ValueError("a sampled request needs the draft distributions of its guesses")
    p = probabilities(target_logits, [params] * (n + 1)).double()
    out: list[int] = []
    for j, x in enumerate(guesses):
        px, qx = float(p[j, x]), float(q[j, x])
        u = float(torch.rand((), generator=generator, device=generator.device, dtype=torch.float64))
        if qx > 0 and u * qx < px:  # u < p/q without dividing
            out.append(x)
            continue
        residual = (p[j] - q[j].double()).clamp_min(0.0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p[j]
        return j, out + [_draw(residual / residual.sum(), generator)]
    return n, out + [_draw(p[n], generator)]


# ---------------------------------------------------------------------- calibration


@dataclass
class Calibration:
    """Per-position temperatures of the confidence head: c_k = sigmoid(logit_k / T_k).

    Fitted with Sequential Temperature Scaling (the paper's STS): left to right, each
    T_k is the grid value that minimises the expected calibration error of the prefix
    survival prod_{i<=k} c_i against observed prefix acceptance, the earlier
    temperatures held fixed. Order-preserving at each position.
    """

    temperatures: list[float]
    ece_before: list[float] = field(default_factory=list)
    ece_after: list[float] = field(default_factory=list)

    @classmethod
    def identity(cls, positions: int) -> "Calibration":
        return cls([1.0] * positions)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Confidence logits [..., K] -> calibrated c [..., K]."""
        t = torch.tensor(self.temperatures[: logits.shape[-1]], dtype=torch.float32, device=logits.device)
        return torch.sigmoid(logits.float() / t)

    def to_dict(self) -> dict:
        return {"temperatures": [round(t, 6) for t in self.temperatures],
                "ece_before": [round(e, 6) for e in self.ece_before], "ece_after": [round(e, 6) for e in self.ece_after]}

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        temperatures = [float(t) for t in data["temperatures"]]
        if not temperatures or any(not math.isfinite(t) or t <= 0 for t in temperatures):
            raise ValueError(f"calibration temperatures must be positive numbers, got {data['temperatures']!r}")
        return cls(temperatures, list(data.get("ece_before", [])), list(data.get("ece_after", [])))

    @classmethod
    def fit(cls, logits: torch.Tensor, accepted: torch.Tensor, bins: int = 10,
            grid: torch.Tensor | None = None) -> "Calibration":
        """STS on held-out blocks: ``logits`` [N, K] confidence logits, ``accepted`` [N, K]
        bool, True where the first k guesses all survived verification."""
        grid = torch.logspace(-1.0, 1.5, 241) if grid is None else grid
        logits, labels = logits.double(), accepted.double()
        temperatures, before, after = [], [], []
        prefix = torch.ones(logits.shape[0], dtype=torch.float64)
        raw_prefix = torch.ones_like(prefix)
        for k in range(logits.shape[1]):
            raw_prefix = raw_prefix * torch.sigmoid(logits[:, k])
            before.append(expected_calibration_error(raw_prefix, labels[:, k], bins))
            errors = torch.stack([torch.tensor(expected_calibration_error(prefix * torch.sigmoid(logits[:, k] / t),
                                                                           labels[:, k], bins)) for t in grid])
            best = float(grid[int(errors.argmin())])
            temperatures.append(best)
            prefix = prefix * torch.sigmoid(logits[:, k] / best)
            after.append(float(errors.min()))
        return cls(temperatures, before, after)


def expected_calibration_error(predicted: torch.Tensor, observed: torch.Tensor, bins: int = 10) -> float:
    """ECE of probabilities ``predicted`` [N] against 0/1 outcomes ``observed`` [N], equal-width bins."""
    index = (predicted * bins).long().clamp_(0, bins - 1)
    pred = torch.zeros(bins, dtype=torch.float64).scatter_add_(0, index, predicted.double())
    obs = torch.zeros(bins, dtype=torch.float64).scatter_add_(0, index, observed.double())
    return float((pred - obs).abs().sum() / max(1, predicted.numel()))


# ---------------------------------------------------------------------- cost and scheduler


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


# ---------------------------------------------------------------------- metrics


@dataclass
class SpecMetrics:
    """Counters of a speculative batcher.

    ``passes``: backbone verify passes; ``request_steps``: (request, pass) pairs;
    ``emitted``: tokens out; ``accepted``: guesses accepted; ``verified``: guesses
    verified; ``verify_lengths[l]``: how often a request was scheduled l guesses.
    """

    passes: int = 0
    request_steps: int = 0
    emitted: int = 0
    accepted: int = 0
    verified: int = 0
    verify_lengths: dict[int, int] = field(default_factory=dict)

    @property
    def acceptance_length(self) -> float:
        """Tokens per request per pass (accepted guesses + the target's own token)."""
        return self.emitted / max(1, self.request_steps)

    @property
    def tokens_per_pass(self) -> float:
        """Tokens out per backbone pass, over the whole batch."""
        return self.emitted / max(1, self.passes)

    def to_dict(self) -> dict:
        return {
            "passes": self.passes, "request_steps": self.request_steps, "emitted": self.emitted,
            "accepted": self.accepted, "verified": self.verified,
            "acceptance_length": round(self.acceptance_length, 4),
            "tokens_per_pass": round(self.tokens_per_pass, 4),
            "guess_acceptance_rate": round(self.accepted / max(1, self.verified), 4),
            "verify_lengths": {str(k): v for k, v in sorted(self.verify_lengths.items())},
        }
