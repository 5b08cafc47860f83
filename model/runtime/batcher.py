"""Continuous batching over the engine: requests join and leave between steps.

A :class:`Batcher` schedules the running requests of one decoder (each a
:class:`model.runtime.sequence.Sequence`: its cache, sampling state and output). ``add`` admits a
request whose prompt went through the prefill (its cache and decoder input are
given, or are computed here for in-process use), replays the decoder half and
samples its first token; ``step`` decodes one token for every running request in
one batched engine call. Each generated token is reported as a :class:`TokenEvent`
(with text when a tokenizer is given); finished requests leave the batch.

Speculative mode (``speculation=``, :mod:`model.runtime.speculative`): each ``step`` drafts
guesses for every request with the DSpark drafter, schedules how many of them to
verify (Algorithm 1, or a fixed k), verifies them all in one backbone pass, and
reports every accepted token plus the target's own token, in order. A request that
finishes inside a step (stop token, stop string, length) keeps no token after its
last one in its cache, so ``on_finish`` sees the same cache as without speculation.

The batcher knows nothing of Ray or HTTP: the decoder actor drives it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..tokenizer import Tokenizer
from .cache import SequenceCache
from .engine import Engine
from .grammar import Constraint, GrammarCompiler, apply_masks
from .inputs import DecoderInput
from .prefix_scheduler import MODES, StepCost, VerifyRecord, schedule
from .sampling import SamplingParams, StopChecker, make_generator, sample, shape_logits
from .sequence import Sequence, TokenEvent
from .speculative import SpecMetrics, SpeculativeDrafter, accept_tokens

__all__ = ["Batcher", "Speculation", "TokenEvent", "generate"]


@dataclass
class Speculation:
    """How a batcher speculates: ``mode`` "scheduled" (Algorithm 1 on ``cost``), "fixed"
    (``k`` guesses per request) or "off" (plain decoding, for comparison)."""

    drafter: SpeculativeDrafter
    mode: str = "scheduled"
    k: int = 3
    cost: StepCost | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculation mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "fixed" and not 0 <= self.k <= self.drafter.block_size:
            raise ValueError(f"fixed k must be in 0..{self.drafter.block_size}, got {self.k}")
        if self.mode == "scheduled" and self.cost is None:
            raise ValueError("the scheduled mode needs a step-cost table (StepCost.profile)")


class Batcher:
    """Runs many requests through one engine, one batched decode step at a time."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None = None, eos_token_ids: tuple[int, ...] = (),
                 max_batch: int = 64, on_finish: Callable[[str, SequenceCache, list[int]], None] | None = None,
                 speculation: Speculation | None = None):
        """``on_finish(request_id, cache, tokens)`` runs when a request ends normally
        (not when cancelled): the cache holds every token fed so far."""
        self.engine, self.tokenizer = engine, tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_batch = max_batch
        self.on_finish = on_finish
        self.speculation = speculation
        self.metrics = SpecMetrics()
        self.trace: list[VerifyRecord] | None = None  # a list: each speculative step's record is appended
        self.running: dict[str, Sequence] = {}
        self._grammars: GrammarCompiler | None = None  # built at the first request with a grammar
        image = engine.image_token_id
        self._image_id = None if image is None else torch.tensor([image], device=engine.model.embed.weight.device)

    def can_add(self) -> bool:
        return len(self.running) < self.max_batch

    def add(self, request_id: str, params: SamplingParams, prompt: list[int] | None = None,
            cache: SequenceCache | None = None, inputs: DecoderInput | None = None) -> TokenEvent:
        """Admit a request and return its first token.

        Either ``prompt`` (prefilled here) or a prefilled ``cache`` with its decoder
        ``inputs`` (from the prefill pool) must be given.
        """
        if request_id in self.running:
            raise ValueError(f"request {request_id!r} is already running")
        if not self.can_add():
            raise RuntimeError("batch is full")
        if cache is None:
            if not prompt:
                raise ValueError("a request needs a non-empty prompt")
            cache = self.engine.new_cache()
            inputs = self.engine.prefill(cache, prompt)
        drafter = self.speculation.drafter if self.speculation is not None else None
        tap = drafter.tap() if drafter is not None else None
        constraint = self._constraint(params)
        logits = self.engine.replay(cache, inputs, tap=tap)
        running = Sequence(
            request_id, cache, params,
            None if params.greedy else make_generator(params, logits.device),
            StopChecker(params, self.eos_token_ids),
            self.tokenizer.detokenizer() if self.tokenizer is not None else None,
            constraint=constraint,
        )
        if tap is not None:
            features = tap.features()
            positions = torch.arange(cache.length - features.shape[0], cache.length, device=features.device)
            running.context = drafter.extend([None], [features], [positions])[0]
        self.running[request_id] = running
        return self._emit(running, logits[None])

    def _constraint(self, params: SamplingParams) -> Constraint | None:
        """A fresh position in the request's grammar (None without one)."""
        if params.grammar is None:
            return None
        if self.tokenizer is None:
            raise ValueError("a grammar needs the batcher's tokenizer")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.json, self.tokenizer.vocab_size, self.tokenizer.special.eos)
        vocab = self.engine.model.embed.weight.shape[0]
        return self._grammars.constraint(params.grammar, vocab, params.grammar_after)

    def step(self) -> list[TokenEvent]:
        """One decode step for every running request: one new token each, or in
        speculative mode every accepted guess and the target's token."""
        batch = list(self.running.values())
        if not batch:
            return []
        if self.speculation is not None and self.speculation.mode != "off":
            return self._speculative_step(batch)
        logits = self.engine.decode([(r.cache, [r.tokens[-1]]) for r in batch])
        self._count(len(batch), [0] * len(batch), [0] * len(batch), [1] * len(batch))
        return [self._emit(r, out[-1:]) for r, out in zip(batch, logits)]

    def _speculative_step(self, batch: list[Sequence]) -> list[TokenEvent]:
        spec = self.speculation
        drafter = spec.drafter
        params = [r.params for r in batch]
        drafted = drafter.propose([r.context for r in batch], [r.tokens[-1] for r in batch], params,
                                  [r.generator for r in batch], [r.constraint for r in batch])
        # Never verify more guesses than a request may still emit (its length limit).
        room = torch.tensor([r.room for r in batch])
        allowed = torch.arange(drafter.block_size)[None] < room[:, None]
        if spec.mode == "fixed":
            lengths = [min(spec.k, int(n)) for n in room]
        else:
            lengths = schedule(drafted.survival * allowed, spec.cost)
        guesses = drafted.proposal.tokens.tolist()
        tap = drafter.tap()
        logits, rewinds = self.engine.verify(
            [(r.cache, [r.tokens[-1]] + guesses[i][: lengths[i]]) for i, r in enumerate(batch)], tap)
        events, finished, accepted, emitted = [], [], [], []
        extend, lo = [], 0
        for i, r in enumerate(batch):
            q = drafted.q[i] if drafted.q is not None and not r.params.greedy else None
            shaped = self._shaped(logits[i], r, guesses[i][: lengths[i]])
            if r.constraint is not None:  # a guess outside the grammar has probability 0: rejected
                walk = drafted.walks.get(i)
                masks = walk.masks_for(guesses[i][: lengths[i]]) if walk is not None else None
                if masks is None:  # not drafted under the grammar
                    masks = r.constraint.masks_along(guesses[i][: lengths[i]])
                shaped = apply_masks(shaped, masks)
            m, tokens = accept_tokens(shaped, guesses[i][: lengths[i]], r.params, r.generator, q)
            kept, done = 0, False
            for position, token in enumerate(tokens):
                event = r.feed(token, logits[i][position])
                events.append(event)
                kept += 1
                if event.finish_reason is not None:
                    done = True
                    break
            # The cache keeps the anchor and the emitted tokens before the last one.
            self.engine.accept(r.cache, rewinds[i], kept)
            if done:
                finished.append(r)
            else:
                extend.append((r, tap.features(lo, lo + kept), torch.arange(rewinds[i].length, r.cache.length)))
            lo += 1 + lengths[i]
            accepted.append(m)
            emitted.append(kept)
        if extend:
            contexts = drafter.extend([r.context for r, _, _ in extend], [f for _, f, _ in extend],
                                      [p for _, _, p in extend])
            for (r, _, _), context in zip(extend, contexts):
                r.context = context
        self._count(len(batch), lengths, accepted, emitted)
        if self.trace is not None:
            self.trace.append(VerifyRecord((drafted.survival.cpu() * allowed).numpy(), allowed.sum(dim=1).numpy(),
                                           np.array(lengths), np.array(accepted)))
        for r in finished:
            self._finish(r)
        return events

    def _count(self, requests: int, lengths: list[int], accepted: list[int], emitted: list[int]) -> None:
        m = self.metrics
        m.passes += 1
        m.request_steps += requests
        m.emitted += sum(emitted)
        m.accepted += sum(accepted)
        m.verified += sum(lengths)
        for length in lengths:
            m.verify_lengths[length] = m.verify_lengths.get(length, 0) + 1

    def cancel(self, request_id: str) -> None:
        """Drop a request (client gone); its cache is released with it."""
        self.running.pop(request_id, None)

    def _emit(self, running: Sequence, logits: torch.Tensor) -> TokenEvent:
        """Sample ``running``'s next token from ``logits`` [1, V] and record it."""
        shaped = self._shaped(logits, running)
        if running.constraint is not None:
            shaped = apply_masks(shaped, [running.constraint.mask()])
        event = running.feed(int(sample(shaped, [running.params], [running.generator])[0]), logits[0])
        if event.finish_reason is not None:
            self._finish(running)
        return event

    def _shaped(self, logits: torch.Tensor, running: Sequence, continuation: list[int] = ()) -> torch.Tensor:
        """``shape_logits``, and the image placeholder made impossible: its id stands for
        an image's embeddings, which no answer has (the next turn would carry an image
        token without an image). A guess of it is rejected like any other."""
        shaped = shape_logits(logits, running.params, running.tokens, continuation)
        if self.engine.image_token_id is None:
            return shaped
        return shaped.index_fill(-1, self._image_id, float("-inf"))  # a new tensor: logprobs read the model's

    def _finish(self, running: Sequence) -> None:
        del self.running[running.request_id]
        if self.on_finish is not None:
            self.on_finish(running.request_id, running.cache, running.tokens)


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             eos_token_ids: tuple[int, ...] = (), max_batch: int = 64,
             speculation: Speculation | None = None, tokenizer: Tokenizer | None = None) -> list[list[int]]:
    """Generate for every prompt with continuous batching; returns the new token ids.

    ``params``: one for all prompts, or one per prompt. ``tokenizer``: needed when a
    request has a grammar. A stop token ends a request and is not returned.
    """
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError("give one SamplingParams, or one per prompt")
    batcher = Batcher(engine, tokenizer, eos_token_ids=eos_token_ids, max_batch=max_batch, speculation=speculation)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    waiting = list(range(len(prompts)))

    def record(event: TokenEvent) -> None:
        stops = set(eos_token_ids) | set(per_prompt[int(event.request_id)].stop_token_ids)
        if not (event.finish_reason == "stop" and event.token_id in stops):
            outputs[event.request_id].append(event.token_id)

    while waiting or batcher.running:
        while waiting and batcher.can_add():
            i = waiting.pop(0)
            record(batcher.add(str(i), per_prompt[i], prompt=prompts[i]))
        for event in batcher.step():
            record(event)
    return [outputs[str(i)] for i in range(len(prompts))]
