"""One running request of a decoder: its cache, its sampling state, its output so far.

A :class:`Sequence` turns each token the batcher samples (or accepts from a verified
guess) into a :class:`TokenEvent`: it keeps the token, detokenises it incrementally
and checks the stop conditions. The batcher (:mod:`model.runtime.batcher`) schedules;
this holds what belongs to one request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tokenizer import IncrementalDetokenizer
from .cache import SequenceCache
from .sampling import SamplingParams, StopChecker, token_logprobs
from .grammar import Constraint
from .speculative import DraftContext


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request; ``finish_reason`` is set on its last."""

    request_id: str
    token_id: int
    text: str
    finish_reason: str | None = None
    logprob: float | None = None  # when the request asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class Sequence:
    """A running request: ``cache`` holds every token fed so far, ``tokens`` the
    generated ones (the last not yet fed); ``context`` is the drafter's window."""

    request_id: str
    cache: SequenceCache
    params: SamplingParams
    generator: torch.Generator | None
    stop: StopChecker
    detokenizer: IncrementalDetokenizer | None
    tokens: list[int] = field(default_factory=list)
    context: DraftContext | None = None
    constraint: Constraint | None = None  # the grammar the answer follows, if any

    @property
    def room(self) -> int:
        """Tokens it may still emit after the next one (its length limit)."""
        return max(0, self.params.max_tokens - len(self.tokens) - 1)

    def feed(self, token: int, logits: torch.Tensor | None = None) -> TokenEvent:
        """Record one generated token and check the stop conditions. ``logits`` [V]:
        the model's logits the token was drawn under (for its logprobs, if asked)."""
        self.tokens.append(token)
        if self.constraint is not None:
            self.constraint.advance(token)
        text = self.detokenizer.push(token) if self.detokenizer is not None else ""
        update = self.stop.feed(token, text)
        if update.finish_reason == "length" and self.detokenizer is not None:
            update = type(update)(update.text + self.detokenizer.flush(), update.finish_reason)
        logprob, top = None, ()
        if self.params.logprobs is not None and logits is not None:
            logprob, top = token_logprobs(logits, token, self.params.logprobs)
        return TokenEvent(self.request_id, token, update.text, update.finish_reason, logprob, top)
