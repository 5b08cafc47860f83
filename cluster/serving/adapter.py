"""What an API adapter does for the router: parse a body once into the internal request,
and render the answers, whole or streamed.

Each generation API (chat, completions: :mod:`cluster.serving.openai_adapter`; Responses:
:mod:`cluster.serving.responses_adapter`) implements :class:`Adapter`; the ingress
(:mod:`cluster.serving.ingress`) renders, plans and dispatches the request between its
:meth:`~Adapter.parse` and its :meth:`~Adapter.body` or :meth:`~Adapter.stream`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cluster.serving.answers import Answer
from cluster.serving.request import GenerationRequest
from storage.keys import ObjectKey


@dataclass(frozen=True)
class Exchange:
    """One request being answered: the internal ``request``, what its API parsed beside
    it (``parsed``: the Responses request, None for chat and completions), its id, its
    prompt's length in tokens, and when it came (``time.perf_counter``).
    ``prompt_cache``: the names of its prompt's chunks, and ``shared_cache`` those of
    them in a prefix shared between tenants (never a tenant's to delete)."""

    request: GenerationRequest
    parsed: Any
    rid: str
    prompt_tokens: int
    start: float
    prompt_cache: tuple[ObjectKey, ...] = ()
    shared_cache: frozenset[ObjectKey] = frozenset()

    def cache_of(self, answer: Answer) -> list[ObjectKey]:
        """The names of what the store keeps of the conversation after ``answer``: the
        prompt's chunks and what the answer stored, but the shared prefix's."""
        names = [*self.prompt_cache, *answer.stored]
        return [key for key in dict.fromkeys(names) if key not in self.shared_cache]


@dataclass(frozen=True)
class Totals:
    """What a request's answers add up to, for its usage and its metrics."""

    prompt: int
    cached: int
    generated: int
    ttft: float | None

    @classmethod
    def of(cls, answers: list[Answer], prompt: int | None = None) -> Totals:
        first = answers[0]
        return cls(first.admission.prompt_tokens if prompt is None else prompt, first.admission.cached_tokens,
                   sum(len(answer.tokens) for answer in answers), first.ttft)


@dataclass(frozen=True)
class Model:
    """What parsing knows of the model: its name (requests name it, answers carry it),
    the most tokens the server lets an answer have (None: the context's room), the
    vocabulary's size, how an image is read (None: the model reads none) and how many a
    request may have."""

    name: str
    max_answer: int | None
    vocab_size: int
    read_image: Callable | None = None
    max_images: int = 0


class Adapter(ABC):
    """One generation API for ``model``. ``count(endpoint, status, prompt, cached,
    generated, ttft, total_s)``: records a request's metrics (a coroutine);
    ``record(endpoint, status)``: records a failed one."""

    endpoint: str

    def __init__(self, model: Model, count: Callable[..., Awaitable[None]], record: Callable[[str, str], None]):
        self.model, self.count, self.record = model, count, record

    async def history(self, data: dict) -> list[dict]:
        """The stored items a request continues (read before it is parsed): none here."""
        return []

    @abstractmethod
    def parse(self, data: dict, history: list[dict]) -> tuple[GenerationRequest, Any]:
        """(the internal request, what the API keeps beside it): CPU work, off the event loop."""

    @abstractmethod
    def new_id(self) -> str:
        """The id of a new answer."""

    @abstractmethod
    async def body(self, exchange: Exchange, answers: list[Answer]) -> dict:
        """The unstreamed answer's body (read whole), or an ApiError."""

    @abstractmethod
    def stream(self, exchange: Exchange, answers: list[Answer]) -> AsyncIterator[bytes]:
        """The streamed answer's server-sent events, its metrics counted at its end."""

    async def count_answered(self, exchange: Exchange, totals: Totals) -> None:
        """Record a request answered whole."""
        await self.count(self.endpoint, "200", totals.prompt, totals.cached, totals.generated, totals.ttft,
                         time.perf_counter() - exchange.start)
