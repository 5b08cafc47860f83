"""DSpark speculative decoding: drafting, lossless verification, and the goodput scheduler.

One speculative step for a batch of requests (:class:`model.runtime.batcher.Batcher` drives it):

1. **Draft** (:meth:`SpeculativeDrafter.propose`): every request's anchor (its last
   token, not yet fed) and its drafter context (:class:`DraftContext`: the drafter
   layers' window entries of the last ``sliding_window`` fed positions, made from the
   target layers' attention-input streams) give ``dspark_block_size`` guesses in one
   parallel drafter pass, then the Markov head picks them left to right with the
   request's own sampling parameters; the confidence head gives c_1..c_K, calibrated
   per position by temperature (:class:`model.runtime.calibration.Calibration`).
2. **Schedule** (:func:`model.runtime.prefix_scheduler.schedule`): how many guesses of
   each request to verify. ``"scheduled"`` is Algorithm 1 of the DSpark paper with its
   early stop, on the steps-per-second table
   :class:`~model.runtime.prefix_scheduler.StepCost` profiled when the decoder starts;
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

This module holds the draft, the acceptance and the counters; the confidence head's
calibration is :mod:`model.runtime.calibration`, the cost table and the scheduler
:mod:`model.runtime.prefix_scheduler`.

No I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..dspark import DSparkDrafter, Proposal
from ..transformer import Tap
from .calibration import Calibration
from .engine import Engine
from .sampling import SamplingParams, probabilities
from .weight_layout import store_input_major


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

    def __init__(self, drafter: DSparkDrafter, engine: Engine, calibration: Calibration | None = None):
        self.drafter, self.engine = drafter.eval(), engine
        store_input_major(drafter)  # (as the engine keeps the model's: model.runtime.weight_layout)
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
