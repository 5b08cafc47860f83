"""Continuous batching over the engine: requests join and leave between steps.

A :class:`Batcher` owns the running requests of one decoder. ``add`` admits a
request whose prompt went through the prefill (its cache and decoder input are
given, or are computed here for in-process use), replays the decoder half and
samples its first token; ``step`` decodes one token for every running request in
one batched engine call. Each generated token is reported as a :class:`TokenEvent`
(with text when a tokenizer is given); finished requests leave the batch.

The batcher knows nothing of Ray or HTTP: the decoder actor drives it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cache import SequenceCache
from .chat import IncrementalDetokenizer, Tokenizer
from .engine import DecoderInput, Engine
from .sampling import SamplingParams, StopChecker, make_generator, sample


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request; ``finish_reason`` is set on its last."""

    request_id: str
    token_id: int
    text: str
    finish_reason: str | None = None


@dataclass
class _Running:
    request_id: str
    cache: SequenceCache
    params: SamplingParams
    generator: torch.Generator | None
    stop: StopChecker
    detokenizer: IncrementalDetokenizer | None
    tokens: list[int] = field(default_factory=list)


class Batcher:
    """Runs many requests through one engine, one batched decode step at a time."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None = None, eos_token_ids: tuple[int, ...] = (),
                 max_batch: int = 64, on_finish: Callable[[str, SequenceCache, list[int]], None] | None = None):
        """``on_finish(request_id, cache, tokens)`` runs when a request ends normally
        (not when cancelled): the cache holds every token fed so far."""
        self.engine, self.tokenizer = engine, tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_batch = max_batch
        self.on_finish = on_finish
        self.running: dict[str, _Running] = {}

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
        logits = self.engine.replay(cache, inputs)
        running = _Running(
            request_id, cache, params,
            None if params.greedy else make_generator(params, logits.device),
            StopChecker(params, self.eos_token_ids),
            self.tokenizer.detokenizer() if self.tokenizer is not None else None,
        )
        self.running[request_id] = running
        return self._emit(running, logits[None])

    def step(self) -> list[TokenEvent]:
        """One decode step for every running request (their last token in, a new one out)."""
        batch = list(self.running.values())
        if not batch:
            return []
        logits = self.engine.decode([(r.cache, [r.tokens[-1]]) for r in batch])
        return [self._emit(r, out[-1:]) for r, out in zip(batch, logits)]

    def cancel(self, request_id: str) -> None:
        """Drop a request (client gone); its cache is released with it."""
        self.running.pop(request_id, None)

    def _emit(self, running: _Running, logits: torch.Tensor) -> TokenEvent:
        token = int(sample(logits, [running.params], [running.generator])[0])
        running.tokens.append(token)
        text = running.detokenizer.push(token) if running.detokenizer is not None else ""
        update = running.stop.feed(token, text)
        if update.finish_reason is not None:
            if running.detokenizer is not None and update.finish_reason == "length":
                update = type(update)(update.text + running.detokenizer.flush(), update.finish_reason)
            del self.running[running.request_id]
            if self.on_finish is not None:
                self.on_finish(running.request_id, running.cache, running.tokens)
        return TokenEvent(running.request_id, token, update.text, update.finish_reason)


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams,
             eos_token_ids: tuple[int, ...] = (), max_batch: int = 64) -> list[list[int]]:
    """Generate for every prompt with continuous batching; returns the new token ids.

    A stop token ends a request and is not returned.
    """
    batcher = Batcher(engine, eos_token_ids=eos_token_ids, max_batch=max_batch)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    waiting = list(range(len(prompts)))

    stop_ids = set(eos_token_ids) | set(params.stop_token_ids)

    def record(event: TokenEvent) -> None:
        if not (event.finish_reason == "stop" and event.token_id in stop_ids):
            outputs[event.request_id].append(event.token_id)

    while waiting or batcher.running:
        while waiting and batcher.can_add():
            i = waiting.pop(0)
            record(batcher.add(str(i), params, prompt=prompts[i]))
        for event in batcher.step():
            record(event)
    return [outputs[str(i)] for i in range(len(prompts))]
